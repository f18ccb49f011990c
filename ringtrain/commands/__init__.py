"""One module per ``ringtrain`` subcommand: ``HELP``, ``add_arguments(parser)``, ``run(args)``."""

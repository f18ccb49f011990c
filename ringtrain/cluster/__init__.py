"""Where ranks run: the cluster around the job.

* :mod:`~ringtrain.cluster.topology`: a rank's place, asked of MPI (:class:`~ringtrain.cluster.topology.TaskSpec`);
* :mod:`~ringtrain.cluster.hostfiles`: hostfiles and host lists, parsed and written;
* :mod:`~ringtrain.cluster.launch`: the ``mpirun`` command line for ``ringtrain launch``;
* :mod:`~ringtrain.cluster.jobs`: running a job, forwarding signals, restarting it;
* :mod:`~ringtrain.cluster.rank_log`: one log file per rank.

This ``__init__`` imports nothing, so the command line stays light: import the module you need.
"""

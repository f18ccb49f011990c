"""The reduction op constants of Horovod's API, and what each means to ringtrain.

The values are Horovod's own (``horovod.common.basics``), so a script that
stored or compared them keeps working.
"""

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "OP_NAMES", "op_name"]

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "product"}


def op_name(op):
    """The name of a reduction op constant (pure); raises ValueError naming the valid ones."""
    try:
        return OP_NAMES[op]
    except (KeyError, TypeError):
        choices = ", ".join(f"{v} ({k})" for k, v in OP_NAMES.items())
        raise ValueError(f"unknown reduction op {op!r}; choose one of {choices}") from None

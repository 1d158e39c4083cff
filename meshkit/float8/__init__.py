"""float8 training of the decoder blocks' linears through torchao (`Plan.float8`): `rules` (the recipes,
what a plan and a model's dimensions must satisfy; a leaf `plan.py` imports) and `convert` (which
linears convert, the FSDP float8 all-gather and its scales, what selective checkpointing keeps).
torchao is imported only when a plan asks for float8 (`meshkit._compat.float8`).
"""

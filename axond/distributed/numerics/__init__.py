"""What a reduction computes, whatever the backend: the operators, their NumPy kernels, low-precision sums.

    reduce_op.py       `ReduceOp` (SUM, AVG, MIN, ..., the bitwise ops) and which of them are bitwise
    reducers.py        the in-place NumPy reduction of each op, the dtypes each accepts, wider accumulators
    low_precision.py   bfloat16 / float16 sums moved in their own dtype and rounded once
    bf16.py            bfloat16 known by name, ml_dtypes imported only where the dtype is made
"""

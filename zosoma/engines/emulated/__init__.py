"""The emulated low-precision engine (PrecisionOps, precision_ops): every forward in bf16, fp16 or
int8 on the CPU, as zosoma.model.number_formats specifies; precision_reference is the plain
NumPy version, precision_kernels the compiled one checked against it."""

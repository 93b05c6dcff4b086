# tests/interp/ needs TRITON_INTERPRET=1 before triton is imported; tests/test_kernels.py runs it
# in a child process, so the main session never collects it.
collect_ignore = ["interp"]

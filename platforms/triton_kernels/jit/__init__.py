"""``@triton.jit`` device code and launchers. Importing anything here imports triton."""

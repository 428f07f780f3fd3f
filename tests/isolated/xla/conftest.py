"""The torch-xla suite runs on the XLA CPU device (no TPU needed)."""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

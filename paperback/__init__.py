"""paperback: run large language models lighter."""

import os

# paperback never downloads models: keep huggingface_hub from trying, unless the user says otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"

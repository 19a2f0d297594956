"""Shared settings of the examples: UNMASK_BASE_URL (default http://127.0.0.1:8000/v1), UNMASK_API_KEY."""
import os

BASE_URL = os.environ.get("UNMASK_BASE_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("UNMASK_API_KEY", "not-needed")   # any key unless `unmask serve --api-key` is set

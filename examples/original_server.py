"""The server example of the original tensorshare README, unchanged."""
from tensorshare import run_server

run_server(8000)

"""The worker example of the original tensorshare README.

(Unchanged but for the port: ``--port``, 8000 by default; ``--help``.)
"""
from original_args import port

PORT = port(__doc__)
from tensorshare import RLWorker
import torch
from threading import Thread
from time import sleep

def generate_rollouts(ts):
    net = torch.nn.Linear(10, 2)
    
    try:
        # Load latest published parameters
        params = ts.get_parameters()
        if params is None:  # In case no parameters were available on the server
            params = ts.await_new_parameters(timeout=None)   # We wait until they are available
        net.load_state_dict(params)
        
        for _ in range(300):
            # Generate a rollout
            x = torch.randn(1, 10)
            ts.add_data(x)
            sleep(.2)
            # Load newest parameters
            params = ts.get_parameters()    # This returns the latest published parameters
            net.load_state_dict(params)
    finally:
        ts.stop()
    

tmp = RLWorker('localhost', PORT)
Thread(target=generate_rollouts, args=(tmp, ), daemon=True).start()
tmp.start()

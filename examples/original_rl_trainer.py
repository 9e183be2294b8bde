"""The trainer example of the original tensorshare README.

(Unchanged but for the port: ``--port``, 8000 by default; ``--help``.)
"""
from original_args import port

PORT = port(__doc__)
from tensorshare import RLTrainer
import torch
from threading import Thread
from time import sleep


def train(ts):
    net = torch.nn.Linear(10, 2)
    try:
        for i_iter in range(10):
            ts.publish_parameters(net.state_dict())
            
            # Aggregate a batch
            batch_size = 16
            data_buffer = torch.zeros(batch_size, 10)
            i = 0
            while i < batch_size:
                data = ts.get_data()
                for item in data:
                    data_buffer[i, :] = item
                    i += 1
                    if i == batch_size:
                        break
                sleep(.5)
            
            # Train on the batch
            loss = net(data_buffer).mean()
            print('Iteration', i_iter, 'Loss:', loss)
            loss.backward()
            with torch.no_grad():
                net.weight -= 0.001 * net.weight.grad
                net.weight.grad *= 0
        
            # Publish new parameters
            ts.publish_parameters(net.state_dict())
    finally:
        ts.stop()
    
# Also host the server. In a real application it's better to have a dedicated process host the server.
tmp = RLTrainer('localhost', PORT, host_server=True, filter_version=False)
Thread(target=train, args=(tmp, ), daemon=True).start()
tmp.start()

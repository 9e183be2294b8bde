"""The original tensorshare's ``TensorShare`` docstring example: the server hosted in
the client's own process with ``run_server(8000, start_reactor=False)``.

Its text, with the docstring's two typos fixed (``args(tmp, )`` for
``args=(tmp, )``, which is a NameError as printed) and nothing else changed.

(Unchanged but for the port: ``--port``, 8000 by default; ``--help``.)
"""
from original_args import port

PORT = port(__doc__)
from tensorshare import TensorShare, run_server
from threading import Thread


def example(ts):
    # Define callbacks
    def cb_put(resp):
        print("put response: Status =", resp['status'])
        if resp['status'] == ts.STATUS_ERR:
            print("Got error:", resp['msg'])
        # Call list after put is finished
        ts.list(cb_list)

    def cb_list(resp):
        print("list response: Status =", resp['status'])
        if resp['status'] == ts.STATUS_ERR:
            print("Got error:", resp['msg'])
        else:
            print('list result:', resp['data']) # -> {'bin1': 1}
        # Shut down tensorshare, also stops run_server
        ts.stop()

    # Request to put data, calling cb_put with the result
    ts.put('bin1', list(range(5)), cb_put)

run_server(PORT, start_reactor=False)
tmp = TensorShare('localhost', PORT)
Thread(target=example, args=(tmp, ), daemon=True).start()
try:
    tmp.start()
finally:
    tmp.stop()

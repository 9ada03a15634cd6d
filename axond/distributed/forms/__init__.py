"""The other ways to call the collectives, each over the same ops on the wire as `api` and `ProcessGroup`.

    torch_forms.py   torch.distributed's list forms (`all_gather(tensor_list, tensor)`, ...) beside axond's arrays
    tensor_args.py   torch tensors accepted wherever arrays are (torch imported only when one is passed)
    batch_p2p.py     `batch_isend_irecv` and `P2POp`: a list of sends and receives that cannot deadlock
    objects.py       collectives of picklable Python objects (`all_gather_object`, `broadcast_object_list`, ...)
    seed.py          the seed API's names (`all_reduce_sum`, `sync_gradients`, ...) as thin aliases
"""

"""How hmp stays out of the rest of PyTorch: each module is one rule (regions
hmp leaves alone, optimizer steps, checkpoint recomputes, custom Functions,
RNNs, buffers, weight writes, uncast entry points), and conversion applies
them all through the same small interface."""

"""Stored weight schemes: one module per scheme (dense, codebook, aqlm, rtn), each owning its stored tensors,
its torch reference module and its engine projection; ``registry`` maps a stored weight to its scheme.
``base`` states the contracts (``Scheme``, ``Projection``, ``GateUp``)."""

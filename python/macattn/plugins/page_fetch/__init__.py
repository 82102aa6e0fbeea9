"""Page fetch of the offloaded retrieval-completion decode (issue 20): the pages a step selected and the
device's hot-page cache does not hold, gathered from host memory into the cache by the GPU (``kernel.py``:
reads of pinned host memory through unified addressing, no host synchronisation; launcher ``op.py`` with a
plain-torch twin for CPU tensors). Importing this package needs only torch."""

"""Constants of the emulated link between the network namespaces of ``smoe-bench cluster``
(:mod:`.cluster`), shared with the exchange's model (:mod:`.wire_model`)."""

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, per packet on the veth
ADDR = ("10.213.0.1", "10.213.0.2")  # the two nodes' addresses

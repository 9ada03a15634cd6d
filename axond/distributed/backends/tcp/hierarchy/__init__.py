"""Groups spread over hosts: which members share a host (`topology`) and two-level collectives (`two_level`)."""

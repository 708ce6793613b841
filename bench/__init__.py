"""`pdserve bench`: an open-loop load generator over gRPC, SLO attainment and goodput, and the
interference study: the same trace through each policy in one run. A gRPC client like any
other: it imports only the proto stubs, and starts servers as `pdserve serve` processes."""

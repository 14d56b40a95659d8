"""What the router knows of its replicas between requests: their health and load
(:mod:`.health`), who they are (:mod:`.discovery`), what their caches hold (:mod:`.kvevents`,
:mod:`.cache`), the moves and pre-warming that follow membership (:mod:`.rebalance`) and the
fair queue in front of them (:mod:`.queueing`)."""

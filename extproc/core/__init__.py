"""The request core: a request's path through the router as steps with no I/O (:mod:`.request`),
the effects its drivers carry out (:mod:`.effects`), the admission rules in one place
(:mod:`.admission`), what comes back from the replica (:mod:`.outcome`) and what it is charged
(:mod:`.charging`); below them, what routing a request changes and undoes (:mod:`.bookkeeping`)
and membership, cordons and drains (:mod:`.membership`)."""

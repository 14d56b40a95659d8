"""What discovery reports: the lists its source yields, the memberships applied, the source's failures."""

from __future__ import annotations

from typing import Protocol


class DiscoveryObserver(Protocol):
    """Where the discovery loop reports (the router's metrics implement it)."""

    def discovery_list(self) -> None:
        """The source yielded a replica list."""
        ...

    def membership_applied(self, members: int) -> None:
        """A changed membership of ``members`` replicas (static ones included) was applied."""
        ...

    def discovery_failed(self) -> None:
        """The source failed and will be started again."""
        ...


class NullDiscoveryObserver:
    """The default: nothing is reported."""

    def discovery_list(self) -> None:
        """Not reported."""

    def membership_applied(self, members: int) -> None:
        """Not reported."""

    def discovery_failed(self) -> None:
        """Not reported."""

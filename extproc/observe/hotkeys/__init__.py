"""Hot keys: prefixes that carry a disproportionate share of the traffic, found by sampling
request fingerprints into a bounded heavy-hitter sketch (:mod:`extproc.observe.hotkeys.detector`)."""

from extproc.observe.hotkeys.detector import HotKeyDetector, HotKeySettings

__all__ = ["HotKeyDetector", "HotKeySettings"]

"""The protocol layer: the ext_proc gRPC service and its server."""

from extproc.adapters.server.app import ProcessorServer
from extproc.adapters.server.servicer import ExternalProcessor

__all__ = ["ExternalProcessor", "ProcessorServer"]

"""The protocol layer: the ext_proc gRPC service and its server."""

from extproc.server.app import ProcessorServer
from extproc.server.servicer import ExternalProcessor

__all__ = ["ExternalProcessor", "ProcessorServer"]

"""Errors raised by buffers; the gRPC servicer maps each class to its status code."""


class ReplayError(Exception):
    """Base class: the message names the field, what was expected and what was got."""


class InvalidArgument(ReplayError):
    pass


class NotFound(ReplayError):
    pass


class FailedPrecondition(ReplayError):
    pass


class ResourceExhausted(ReplayError):
    pass


class DeadlineExceeded(ReplayError):
    pass


class Unavailable(ReplayError):
    """The server cannot take the call now; the same call may succeed later (clients retry it)."""

"""Errors raised by buffers; the gRPC servicer maps each class to its status code."""


class ReplayError(Exception):
    """Base class: the message names the field, what was expected and what was got."""


class InvalidArgument(ReplayError, ValueError):
    """A request field out of its domain; a ValueError too, so that callers of the client catch it as one."""


class NotFound(ReplayError):
    pass


class FailedPrecondition(ReplayError):
    pass


class ShortOfDraws(FailedPrecondition):
    """A batch larger than the draws its buffer's steps have left (a remover retires steps after k draws):
    nothing was drawn; a sample that may wait waits for inserts."""


class RingChanged(FailedPrecondition):
    """A draw found no item in a range the writer emptied under it: only a lock-free reader meets it, and
    draws again."""


class ResourceExhausted(ReplayError):
    pass


class DeadlineExceeded(ReplayError):
    pass


class Cancelled(ReplayError):
    """The call ended (cancelled by its client) while the server waited on its behalf."""


# Trailing metadata of a call the server refused before doing anything: the same call may be retried after
# this many milliseconds, whatever its kind (a refused sample has drawn nothing).
RETRY_AFTER_METADATA = "replayd-retry-after-ms"


class Unavailable(ReplayError):
    """The server cannot take the call now; the same call may succeed later (clients retry it)."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

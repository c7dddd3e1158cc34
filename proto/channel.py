"""gRPC settings both ends must agree on."""

DEFAULT_MAX_MESSAGE_BYTES = 512 * 2**20


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC's default 4 MB message limit is far below an Atari batch; both sides raise it alike."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]

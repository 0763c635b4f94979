from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("room", "request_id", "handshakes", "skip_tokens", "dst_block_ids", "num_prompt_tokens", "block_size", "prompt_digest")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKES_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    handshakes: _containers.RepeatedScalarFieldContainer[bytes]
    skip_tokens: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_size: int
    prompt_digest: bytes
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ..., handshakes: _Optional[_Iterable[bytes]] = ..., skip_tokens: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("done", "error")
    class Done(_message.Message):
        __slots__ = ("first_token_id", "num_blocks_sent")
        FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        NUM_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
        first_token_id: int
        num_blocks_sent: int
        def __init__(self, first_token_id: _Optional[int] = ..., num_blocks_sent: _Optional[int] = ...) -> None: ...
    class Error(_message.Message):
        __slots__ = ("message",)
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        message: str
        def __init__(self, message: _Optional[str] = ...) -> None: ...
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    done: RegisterReply.Done
    error: RegisterReply.Error
    def __init__(self, done: _Optional[_Union[RegisterReply.Done, _Mapping]] = ..., error: _Optional[_Union[RegisterReply.Error, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FieldSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "observation", "stack", "stack_axis", "compression", "compression_level")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    STACK_AXIS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    observation: bool
    stack: int
    stack_axis: int
    compression: str
    compression_level: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., observation: _Optional[bool] = ..., stack: _Optional[int] = ..., stack_axis: _Optional[int] = ..., compression: _Optional[str] = ..., compression_level: _Optional[int] = ...) -> None: ...

class CompressedFrames(_message.Message):
    __slots__ = ("field", "frames", "lengths", "spec", "columns")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    field: str
    frames: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    spec: FieldSpec
    columns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, field: _Optional[str] = ..., frames: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[FieldSpec, _Mapping]] = ..., columns: _Optional[_Iterable[str]] = ...) -> None: ...

class UniformSampler(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrioritizedSampler(_message.Message):
    __slots__ = ("alpha",)
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    def __init__(self, alpha: _Optional[float] = ...) -> None: ...

class SamplerConfig(_message.Message):
    __slots__ = ("uniform", "prioritized")
    UNIFORM_FIELD_NUMBER: _ClassVar[int]
    PRIORITIZED_FIELD_NUMBER: _ClassVar[int]
    uniform: UniformSampler
    prioritized: PrioritizedSampler
    def __init__(self, uniform: _Optional[_Union[UniformSampler, _Mapping]] = ..., prioritized: _Optional[_Union[PrioritizedSampler, _Mapping]] = ...) -> None: ...

class FifoRemover(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MaxTimesSampledRemover(_message.Message):
    __slots__ = ("max_times_sampled",)
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    max_times_sampled: int
    def __init__(self, max_times_sampled: _Optional[int] = ...) -> None: ...

class RemoverConfig(_message.Message):
    __slots__ = ("fifo", "max_times_sampled")
    FIFO_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    fifo: FifoRemover
    max_times_sampled: MaxTimesSampledRemover
    def __init__(self, fifo: _Optional[_Union[FifoRemover, _Mapping]] = ..., max_times_sampled: _Optional[_Union[MaxTimesSampledRemover, _Mapping]] = ...) -> None: ...

class MinSizeLimiter(_message.Message):
    __slots__ = ("min_size_to_sample",)
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    min_size_to_sample: int
    def __init__(self, min_size_to_sample: _Optional[int] = ...) -> None: ...

class SampleToInsertRatioLimiter(_message.Message):
    __slots__ = ("min_size_to_sample", "samples_per_insert", "error_buffer")
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    min_size_to_sample: int
    samples_per_insert: float
    error_buffer: float
    def __init__(self, min_size_to_sample: _Optional[int] = ..., samples_per_insert: _Optional[float] = ..., error_buffer: _Optional[float] = ...) -> None: ...

class RateLimiterConfig(_message.Message):
    __slots__ = ("min_size", "sample_to_insert_ratio")
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TO_INSERT_RATIO_FIELD_NUMBER: _ClassVar[int]
    min_size: MinSizeLimiter
    sample_to_insert_ratio: SampleToInsertRatioLimiter
    def __init__(self, min_size: _Optional[_Union[MinSizeLimiter, _Mapping]] = ..., sample_to_insert_ratio: _Optional[_Union[SampleToInsertRatioLimiter, _Mapping]] = ...) -> None: ...

class EpisodicConfig(_message.Message):
    __slots__ = ("fields", "capacity_steps", "reward_field", "sampler", "remover", "rate_limiter", "achieved_goal_field", "desired_goal_field", "capacity_bytes")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_STEPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    REMOVER_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_FIELD_NUMBER: _ClassVar[int]
    ACHIEVED_GOAL_FIELD_FIELD_NUMBER: _ClassVar[int]
    DESIRED_GOAL_FIELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    capacity_steps: int
    reward_field: str
    sampler: SamplerConfig
    remover: RemoverConfig
    rate_limiter: RateLimiterConfig
    achieved_goal_field: str
    desired_goal_field: str
    capacity_bytes: int
    def __init__(self, fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., capacity_steps: _Optional[int] = ..., reward_field: _Optional[str] = ..., sampler: _Optional[_Union[SamplerConfig, _Mapping]] = ..., remover: _Optional[_Union[RemoverConfig, _Mapping]] = ..., rate_limiter: _Optional[_Union[RateLimiterConfig, _Mapping]] = ..., achieved_goal_field: _Optional[str] = ..., desired_goal_field: _Optional[str] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class RolloutConfig(_message.Message):
    __slots__ = ("fields", "num_steps", "num_envs", "gamma", "gae_lambda")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    num_steps: int
    num_envs: int
    gamma: float
    gae_lambda: float
    def __init__(self, fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., num_steps: _Optional[int] = ..., num_envs: _Optional[int] = ..., gamma: _Optional[float] = ..., gae_lambda: _Optional[float] = ...) -> None: ...

class CreateBufferRequest(_message.Message):
    __slots__ = ("name", "episodic", "rollout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPISODIC_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    episodic: EpisodicConfig
    rollout: RolloutConfig
    def __init__(self, name: _Optional[str] = ..., episodic: _Optional[_Union[EpisodicConfig, _Mapping]] = ..., rollout: _Optional[_Union[RolloutConfig, _Mapping]] = ...) -> None: ...

class DeleteBufferRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteBufferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBuffersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBuffersResponse(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[BufferInfo]
    def __init__(self, buffers: _Optional[_Iterable[_Union[BufferInfo, _Mapping]]] = ...) -> None: ...

class DescribeBufferRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class BufferInfo(_message.Message):
    __slots__ = ("name", "kind", "episodic", "rollout", "bytes", "shm_name", "host", "stored_steps", "sampleable_steps", "episodes", "counters", "policy_version", "missing_steps", "rollout_complete", "sample_endpoints")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EPISODIC_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLEABLE_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSING_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    episodic: EpisodicConfig
    rollout: RolloutConfig
    bytes: int
    shm_name: str
    host: str
    stored_steps: int
    sampleable_steps: int
    episodes: int
    counters: _containers.ScalarMap[str, float]
    policy_version: int
    missing_steps: int
    rollout_complete: bool
    sample_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., episodic: _Optional[_Union[EpisodicConfig, _Mapping]] = ..., rollout: _Optional[_Union[RolloutConfig, _Mapping]] = ..., bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., host: _Optional[str] = ..., stored_steps: _Optional[int] = ..., sampleable_steps: _Optional[int] = ..., episodes: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ..., policy_version: _Optional[int] = ..., missing_steps: _Optional[int] = ..., rollout_complete: _Optional[bool] = ..., sample_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("buffer", "steps", "episode_ids", "span_rows", "begins", "ends", "terminated", "span_offsets", "frames")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    SPAN_ROWS_FIELD_NUMBER: _ClassVar[int]
    BEGINS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    SPAN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    steps: bytes
    episode_ids: _containers.RepeatedScalarFieldContainer[int]
    span_rows: _containers.RepeatedScalarFieldContainer[int]
    begins: _containers.RepeatedScalarFieldContainer[bool]
    ends: _containers.RepeatedScalarFieldContainer[bool]
    terminated: _containers.RepeatedScalarFieldContainer[bool]
    span_offsets: _containers.RepeatedScalarFieldContainer[int]
    frames: _containers.RepeatedCompositeFieldContainer[CompressedFrames]
    def __init__(self, buffer: _Optional[str] = ..., steps: _Optional[bytes] = ..., episode_ids: _Optional[_Iterable[int]] = ..., span_rows: _Optional[_Iterable[int]] = ..., begins: _Optional[_Iterable[bool]] = ..., ends: _Optional[_Iterable[bool]] = ..., terminated: _Optional[_Iterable[bool]] = ..., span_offsets: _Optional[_Iterable[int]] = ..., frames: _Optional[_Iterable[_Union[CompressedFrames, _Mapping]]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("requests", "spans", "rows", "episodes_completed", "duplicate_spans")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_SPANS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    spans: int
    rows: int
    episodes_completed: int
    duplicate_spans: int
    def __init__(self, requests: _Optional[int] = ..., spans: _Optional[int] = ..., rows: _Optional[int] = ..., episodes_completed: _Optional[int] = ..., duplicate_spans: _Optional[int] = ...) -> None: ...

class TransitionsMode(_message.Message):
    __slots__ = ("n_step", "gamma")
    N_STEP_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    n_step: int
    gamma: float
    def __init__(self, n_step: _Optional[int] = ..., gamma: _Optional[float] = ...) -> None: ...

class GeometricMode(_message.Message):
    __slots__ = ("discount",)
    DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    discount: float
    def __init__(self, discount: _Optional[float] = ...) -> None: ...

class StatesMode(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SequencesMode(_message.Message):
    __slots__ = ("length", "burn_in", "period", "boundary", "n_step", "gamma")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BURN_IN_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    N_STEP_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    length: int
    burn_in: int
    period: int
    boundary: str
    n_step: int
    gamma: float
    def __init__(self, length: _Optional[int] = ..., burn_in: _Optional[int] = ..., period: _Optional[int] = ..., boundary: _Optional[str] = ..., n_step: _Optional[int] = ..., gamma: _Optional[float] = ...) -> None: ...

class HindsightMode(_message.Message):
    __slots__ = ("strategy", "relabel_ratio", "discount")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RELABEL_RATIO_FIELD_NUMBER: _ClassVar[int]
    DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    relabel_ratio: float
    discount: float
    def __init__(self, strategy: _Optional[str] = ..., relabel_ratio: _Optional[float] = ..., discount: _Optional[float] = ...) -> None: ...

class BatchMode(_message.Message):
    __slots__ = ("transitions", "geometric", "states", "sequences", "hindsight")
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRIC_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    HINDSIGHT_FIELD_NUMBER: _ClassVar[int]
    transitions: TransitionsMode
    geometric: GeometricMode
    states: StatesMode
    sequences: SequencesMode
    hindsight: HindsightMode
    def __init__(self, transitions: _Optional[_Union[TransitionsMode, _Mapping]] = ..., geometric: _Optional[_Union[GeometricMode, _Mapping]] = ..., states: _Optional[_Union[StatesMode, _Mapping]] = ..., sequences: _Optional[_Union[SequencesMode, _Mapping]] = ..., hindsight: _Optional[_Union[HindsightMode, _Mapping]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("buffer", "batch_size", "mode", "seed", "include_keys", "importance_beta", "wait", "decompress")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_KEYS_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_BETA_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    DECOMPRESS_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    batch_size: int
    mode: BatchMode
    seed: int
    include_keys: bool
    importance_beta: float
    wait: bool
    decompress: str
    def __init__(self, buffer: _Optional[str] = ..., batch_size: _Optional[int] = ..., mode: _Optional[_Union[BatchMode, _Mapping]] = ..., seed: _Optional[int] = ..., include_keys: _Optional[bool] = ..., importance_beta: _Optional[float] = ..., wait: _Optional[bool] = ..., decompress: _Optional[str] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("batch", "alignment", "frames")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    alignment: bytes
    frames: _containers.RepeatedCompositeFieldContainer[CompressedFrames]
    def __init__(self, batch: _Optional[bytes] = ..., alignment: _Optional[bytes] = ..., frames: _Optional[_Iterable[_Union[CompressedFrames, _Mapping]]] = ...) -> None: ...

class SampleStreamRequest(_message.Message):
    __slots__ = ("request", "num_batches")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    request: SampleRequest
    num_batches: int
    def __init__(self, request: _Optional[_Union[SampleRequest, _Mapping]] = ..., num_batches: _Optional[int] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("buffer", "keys", "priorities")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, buffer: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("applied", "ignored_stale")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_STALE_FIELD_NUMBER: _ClassVar[int]
    applied: int
    ignored_stale: int
    def __init__(self, applied: _Optional[int] = ..., ignored_stale: _Optional[int] = ...) -> None: ...

class PushRolloutRequest(_message.Message):
    __slots__ = ("buffer", "policy_version", "env_start", "step_start", "steps", "num_envs", "bootstrap")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_START_FIELD_NUMBER: _ClassVar[int]
    STEP_START_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    policy_version: int
    env_start: int
    step_start: int
    steps: bytes
    num_envs: int
    bootstrap: bytes
    def __init__(self, buffer: _Optional[str] = ..., policy_version: _Optional[int] = ..., env_start: _Optional[int] = ..., step_start: _Optional[int] = ..., steps: _Optional[bytes] = ..., num_envs: _Optional[int] = ..., bootstrap: _Optional[bytes] = ...) -> None: ...

class PushRolloutResponse(_message.Message):
    __slots__ = ("missing_steps", "rollout_complete")
    MISSING_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    missing_steps: int
    rollout_complete: bool
    def __init__(self, missing_steps: _Optional[int] = ..., rollout_complete: _Optional[bool] = ...) -> None: ...

class RolloutMinibatchesRequest(_message.Message):
    __slots__ = ("buffer", "minibatch_size", "epochs", "normalize_advantages", "drop_last", "seed")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    MINIBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    minibatch_size: int
    epochs: int
    normalize_advantages: bool
    drop_last: bool
    seed: int
    def __init__(self, buffer: _Optional[str] = ..., minibatch_size: _Optional[int] = ..., epochs: _Optional[int] = ..., normalize_advantages: _Optional[bool] = ..., drop_last: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class FinishRolloutRequest(_message.Message):
    __slots__ = ("buffer", "next_version")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    NEXT_VERSION_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    next_version: int
    def __init__(self, buffer: _Optional[str] = ..., next_version: _Optional[int] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("name", "version", "safetensors", "final")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    safetensors: bytes
    final: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., safetensors: _Optional[bytes] = ..., final: _Optional[bool] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("accepted", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("name", "newer_than")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    name: str
    newer_than: int
    def __init__(self, name: _Optional[str] = ..., newer_than: _Optional[int] = ...) -> None: ...

class FetchWeightsResponse(_message.Message):
    __slots__ = ("version", "safetensors", "final")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    safetensors: bytes
    final: bool
    def __init__(self, version: _Optional[int] = ..., safetensors: _Optional[bytes] = ..., final: _Optional[bool] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "buffers")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    buffers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., buffers: _Optional[_Iterable[str]] = ...) -> None: ...

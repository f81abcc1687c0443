"""An engine build served by Triton's tensorrtllm backend, as ``<name>-engine``
behind Gantry's generate model ``<name>``. Runs in the docker runtime, in the
TensorRT-LLM image the engine was built in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deployments.backends.base import Fail, Placed, PlacementSpec, Resolved, ServingBackend, Target, batching, kv_budget
from deployments.backends.memory import engine_memory, kv_share
from deployments.models import (
    Backend,
    BuildStatus,
    DecodingMode,
    DeploymentModel,
    Dtype,
    EngineBuild,
    InstanceKind,
    ModelKind,
    RegisteredModel,
    Runtime,
)
from triton_server.names import engine_model
from upstream import trtllm


class TensorrtLlm(ServingBackend):
    key = Backend.TENSORRTLLM.value
    kinds = frozenset({ModelKind.LLM.value})
    generative = True
    # Penalties, the logit bias (the engine's embedding_bias), the chosen tokens' log-probabilities,
    # and (a release whose tensorrt_llm model takes num_return_sequences) several sequences.
    generation_extras = frozenset({"penalties", "logit_bias", "logprobs"})
    places_own_gpus = True

    def extras(self, placement: DeploymentModel) -> tuple[frozenset[str], str]:
        build = placement.engine_build
        release = trtllm.release_for(build.trtllm_version) if build else None
        version = build.trtllm_version if build else "unknown"
        missing = [
            "its tensorrt_llm model has no guided decoding input (the engine model Gantry writes is 0.16's)",
            "it returns no alternatives beside the chosen token's log-probability",
        ]
        if release is not None and release.num_return_sequences:
            return self.generation_extras | {"n"}, f"TensorRT-LLM {version}: " + "; ".join(missing)
        missing.append("its tensorrt_llm model takes no num_return_sequences")
        return self.generation_extras, f"TensorRT-LLM {version}: " + "; ".join(missing)

    def serves(self, spec: PlacementSpec, model: RegisteredModel) -> bool:
        return model.kind in self.kinds and spec.engine_build is not None

    def check(self, spec: PlacementSpec, model: RegisteredModel, target: Target, fail: Fail) -> Resolved | None:
        """The gates an engine passes before it is placed: built and verified, in
        the image it will run in (same digest, same TensorRT-LLM), for this
        GPU's SM, on exactly tp*pp GPUs, with a batch size it was built for, and
        a memory fraction that holds its weights and leaves room for a KV cache."""
        host = target.host
        if spec.llm_api:
            fail("llm_api", "serves the checkpoint without an engine: leave engine_build empty")
        build = EngineBuild.objects.filter(pk=spec.engine_build).first()
        if build is None:
            fail("engine_build", f"no engine build {spec.engine_build}")
            return None
        if build.model_id != model.pk:
            fail("engine_build", f"build {build.pk} is of {build.model.name}, not {model.name}")
        if build.status != BuildStatus.SUCCEEDED:
            fail("engine_build", f"build {build.pk} is {build.status}; only succeeded builds can be served")
        elif build.files_missing:
            fail(
                "engine_build", f"build {build.pk}'s engine on {build.host.name}: {build.files_missing}; build it again"
            )
        if target.runtime != Runtime.DOCKER:
            fail(
                "engine_build",
                "engines run in the docker runtime (the host's own tritonserver has no tensorrtllm backend)",
            )
        elif target.image != build.builder_image:
            fail(
                "engine_build",
                f"build {build.pk} was built in {build.builder_image}; serve it from that image, not {target.image}",
            )
        else:
            digest = (host.builders or {}).get("images", {}).get(target.image, "")
            if (host.builders or {}).get("docker_error"):
                fail("engine_build", f"{host.name} could not read its images: {host.builders['docker_error']}")
            elif digest != build.image_digest:
                fail(
                    "engine_build",
                    f"{target.image} on {host.name} is {digest or 'not present'}, but build {build.pk} was made in "
                    f"{build.image_digest} (TensorRT-LLM {build.trtllm_version}): an engine only loads in its own "
                    "image",
                )
        gpus = target.gpus()
        chosen = tuple(sorted(spec.gpu_ids)) or tuple(sorted(gpus)[: build.world_size])
        if len(chosen) != build.world_size:
            fail(
                "gpu_ids",
                f"build {build.pk} is tp {build.tp_size} x pp {build.pp_size} = {build.world_size} GPUs; "
                f"it is given {len(chosen)}",
            )
        for index in chosen:
            gpu = gpus.get(index)
            if gpu is not None and gpu.compute_capability != build.compute_capability:
                fail(
                    "gpu_ids",
                    f"build {build.pk} was built for SM {build.compute_capability} ({build.gpu_name}); "
                    f"GPU {index} is {gpu.name} with SM {gpu.compute_capability}",
                )
        built_batch = int(build.spec.get("max_batch_size", 0))
        if spec.max_batch_size > built_batch:
            fail("max_batch_size", f"build {build.pk} was built for at most {built_batch}")
        _check_runtime_parameters(spec, build, fail)
        tokens = None
        size = min((gpus[i].memory_total_bytes for i in chosen if i in gpus), default=0)
        if size and build.status == BuildStatus.SUCCEEDED:
            sequence = int(build.spec.get("max_seq_len", 1))
            tokens = kv_budget(spec, model, build, size, len(chosen), sequence, fail)
        return Resolved(spec=spec, model=model, backend=self.key, build=build, gpus=chosen, kv_cache_tokens=tokens)

    def share(self, placement: DeploymentModel) -> float:
        return placement.gpu_memory_fraction  # one engine, whatever the instance count

    def processes_per_gpu(self, placement: DeploymentModel) -> int:
        return 0  # the engine runs inside tritonserver

    def memory(self, placement: DeploymentModel) -> dict[str, Any]:
        return engine_memory(
            placement.registered_model, placement.engine_build, placement.gpu_ids, placement.kv_cache_tokens
        )

    def triton_models(self, triton_name: str) -> list[str]:
        return [engine_model(triton_name), triton_name]  # the engine loads before the generate model calling it

    def served_context(self, placement: DeploymentModel) -> int | None:
        built = int(placement.engine_build.spec.get("max_seq_len") or 0) if placement.engine_build else 0
        return built or placement.registered_model.max_position_embeddings

    def placed(self, placement: DeploymentModel, kind: str, host_gpus: tuple[int, ...]) -> Placed:
        return Placed(
            triton_name=placement.triton_name, backend=self.key, instance_kind=InstanceKind.GPU.value,
            instance_count=1, gpus=host_gpus, kv_cache_tokens=placement.kv_cache_tokens,
            kv_cache_share=kv_share(placement.kv_cache_free_gpu_mem_fraction),
            max_seq_len=self.served_context(placement),
            max_num_sequences=int(placement.engine_build.spec.get("max_batch_size", 0)) or None,
        )  # fmt: skip

    def model_spec(self, placement: DeploymentModel, placed: Placed, devices: tuple[int, ...], image: str) -> Any:
        from triton_server.config import TrtllmSpec

        build = placement.engine_build
        release = trtllm.release_for(build.trtllm_version)
        return TrtllmSpec(
            name=placement.triton_name,
            engine_dir=build.output_dir,
            tokenizer_dir=str(placement.registered_model.folder),
            batching=batching(placement),
            gpu_device_ids=devices,
            max_beam_width=int(build.spec.get("max_beam_width", 1)),
            batch_scheduler_policy=placement.batch_scheduler_policy,
            kv_cache_free_gpu_mem_fraction=placed.kv_cache_share,
            max_tokens_in_paged_kv_cache=placed.kv_cache_tokens,
            decoupled=placement.decoupled,
            enable_kv_cache_reuse=placement.enable_kv_cache_reuse,
            decoding_mode=placement.decoding_mode,
            trust_remote_code=placement.registered_model.trust_remote_code,
            num_return_sequences=bool(release and release.num_return_sequences),
        )

    def world_size(self, placement: DeploymentModel) -> int:
        return placement.engine_build.world_size

    def rank_models(self, placement: DeploymentModel) -> list[str]:
        return [engine_model(placement.triton_name)]

    def mounts(self, placement: DeploymentModel) -> set[Path]:
        return {placement.registered_model.folder, Path(placement.engine_build.output_dir)}


def _check_runtime_parameters(spec: PlacementSpec, build: EngineBuild, fail: Fail) -> None:
    """The tensorrt_llm model's runtime parameters, against what the build and its
    release's tensorrtllm backend read."""
    release = trtllm.release_for(build.trtllm_version)
    version = build.trtllm_version or "unknown"
    if spec.max_num_sequences is not None:
        fail(
            "max_num_sequences",
            f"the tensorrtllm backend of TensorRT-LLM {version} reads no max_num_sequences: the sequences in "
            f"flight are bounded by the engine's max_batch_size ({build.spec.get('max_batch_size')} for build "
            f"{build.pk}); build with another max_batch_size to change it",
        )
    if spec.max_seq_len is not None:
        fail(
            "max_seq_len",
            f"an engine's max_seq_len is set when it is built ({build.spec.get('max_seq_len')} for build "
            f"{build.pk}); leave it empty",
        )
    if spec.dtype != Dtype.AUTO:
        fail("dtype", f"an engine runs in the dtype it was built with ({build.spec.get('dtype')}); leave it auto")
    if spec.decoding_mode:
        able = release.decoding_modes if release else frozenset()
        if spec.decoding_mode not in able:
            fail("decoding_mode", f"TensorRT-LLM {version}'s tensorrtllm backend does not take {spec.decoding_mode}")
        elif spec.decoding_mode == DecodingMode.BEAM_SEARCH and int(build.spec.get("max_beam_width", 1)) < 2:
            fail("decoding_mode", f"beam_search needs an engine built with max_beam_width above 1 (build {build.pk})")
    if spec.enable_kv_cache_reuse and not build.spec.get("paged_context_fmha", False):
        fail(
            "enable_kv_cache_reuse",
            f"KV-cache reuse needs an engine built with paged context FMHA; build {build.pk} was built without",
        )

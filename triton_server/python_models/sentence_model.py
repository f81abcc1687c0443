"""Triton python-backend model: sentence embeddings or reranking from a
HuggingFace checkpoint, through the sentence-transformers library.

Gantry copies this file to <repository>/<model>/1/model.py. The checkpoint's
own sentence-transformers configuration decides how texts become vectors
(modules.json: pooling, normalisation, dense layers; sentence_bert_config.json:
max_seq_length; config_sentence_transformers.json: prompts and the similarity
function); a checkpoint without one gets the library's defaults (mean pooling,
not normalised). The config.pbtxt parameters say what to do:
- task "embed": TEXT (strings) in, EMBEDDING and NUM_TOKENS (per text) out,
  with the checkpoint's default prompt if it names one.
- task "rerank": QUERY (one string) and PASSAGES (strings) in, SCORES (one per
  passage) and NUM_TOKENS (all pairs together) out. A cross-encoder checkpoint
  (*ForSequenceClassification) scores each (query, passage) pair with
  sentence-transformers' CrossEncoder (its activation: a sigmoid for one
  label); a bi-encoder scores by the model's own similarity function between
  the query (its "query" prompt) and each passage (its "document" prompt).
Also checkpoint_path, max_seq_len (empty: the checkpoint's own), dtype (auto:
float16 on a GPU as the seeds serve them, float32 on a CPU),
trust_remote_code (the checkpoint's own modelling code), and on a GPU instance
gpu_memory_fraction, which caps this process's PyTorch allocations on that GPU.
"""

import gc
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoConfig


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def _strings(request, name):
    raw = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        checkpoint = _parameter(config, "checkpoint_path", None)
        if checkpoint is None:
            raise pb_utils.TritonModelException("parameter checkpoint_path is missing")
        self.task = _parameter(config, "task", "embed")
        if self.task not in ("embed", "rerank"):
            raise pb_utils.TritonModelException(f"parameter task must be embed or rerank, not {self.task!r}")
        trust = _parameter(config, "trust_remote_code", "false") == "true"
        if args.get("model_instance_kind") == "GPU":
            device_id = int(args["model_instance_device_id"])
            fraction = float(_parameter(config, "gpu_memory_fraction", "0.1"))
            torch.cuda.set_per_process_memory_fraction(fraction, device=device_id)
            device = f"cuda:{device_id}"
        else:
            device = "cpu"
        dtype = _parameter(config, "dtype", "auto")
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "float16"
        options = {
            "device": device,
            "trust_remote_code": trust,
            "local_files_only": True,
            "model_kwargs": {"dtype": getattr(torch, dtype)},
        }
        architectures = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust).architectures or []
        self.cross_encoder = self.task == "rerank" and any(
            a.endswith("ForSequenceClassification") for a in architectures
        )
        max_seq_len = _parameter(config, "max_seq_len", None)
        if self.cross_encoder:
            self.model = CrossEncoder(checkpoint, max_length=int(max_seq_len) if max_seq_len else None, **options)
            self.tokenizer = self.model.tokenizer
            self.max_length = self.model.max_length or self.tokenizer.model_max_length
        else:
            self.model = SentenceTransformer(checkpoint, **options)
            if max_seq_len:
                self.model.max_seq_length = int(max_seq_len)
            self.tokenizer = self.model.tokenizer
            self.max_length = self.model.max_seq_length or self.tokenizer.model_max_length
        self.model.eval()
        # torch, sentence-transformers and the model: out of the collector's full
        # walks, which stalled a batch for 100 ms and more (as in causal_lm_model.py).
        gc.collect()
        gc.freeze()
        pb_utils.Logger.log_info(
            f"{self.task} model {checkpoint} on {device} as {dtype}, {self.max_length} tokens per input "
            f"({'cross-encoder' if self.cross_encoder else 'sentence-transformers'}, torch {torch.__version__}, "
            f"numpy {np.__version__})"
        )

    def execute(self, requests):
        if self.task == "rerank":
            return [self._rerank(request) for request in requests]
        texts_per_request = [_strings(request, "TEXT") for request in requests]
        flat = [text for texts in texts_per_request for text in texts]
        embeddings = self._encode(flat, self.model.encode)
        counts = self._token_counts(flat, self.model.default_prompt_name)
        responses = []
        start = 0
        for texts in texts_per_request:
            chunk = embeddings[start : start + len(texts)]
            tokens = counts[start : start + len(texts)].reshape(-1, 1)
            start += len(texts)
            outputs = [pb_utils.Tensor("EMBEDDING", chunk), pb_utils.Tensor("NUM_TOKENS", tokens)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses

    def _rerank(self, request):
        query = _strings(request, "QUERY")[0]
        passages = _strings(request, "PASSAGES")
        if self.cross_encoder:
            with torch.inference_mode():
                scores = self.model.predict(
                    [(query, p) for p in passages], batch_size=max(1, len(passages)), show_progress_bar=False
                )
            encoded = self.tokenizer([query] * len(passages), passages, truncation=True, max_length=self.max_length)
            tokens = sum(len(ids) for ids in encoded["input_ids"])
        else:
            vector = self._encode([query], self.model.encode_query)
            vectors = self._encode(passages, self.model.encode_document)
            scores = self.model.similarity(torch.from_numpy(vector), torch.from_numpy(vectors)).numpy().reshape(-1)
            tokens = int(self._token_counts([query], "query").sum() + self._token_counts(passages, "document").sum())
        outputs = [
            pb_utils.Tensor("SCORES", np.asarray(scores, dtype=np.float32).reshape(1, -1)),
            pb_utils.Tensor("NUM_TOKENS", np.array([[tokens]], dtype=np.int32)),
        ]
        return pb_utils.InferenceResponse(outputs)

    def _encode(self, texts, encode):
        """Vectors of ``texts`` as the checkpoint's modules make them, in one forward pass."""
        if not texts:
            return np.zeros((0, self.model.get_embedding_dimension()), dtype=np.float32)
        with torch.inference_mode():
            vectors = encode(texts, batch_size=len(texts), convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def _token_counts(self, texts, prompt_name):
        """How many tokens each text took (with its prompt, within max_seq_len), for usage."""
        prompt = (self.model.prompts or {}).get(prompt_name or "", "")
        encoded = self.tokenizer([prompt + t for t in texts], truncation=True, max_length=self.max_length)
        return np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int32)

    def finalize(self):
        self.model = None
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

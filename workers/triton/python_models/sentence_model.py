"""Triton python-backend model: sentence embeddings or reranking from a
HuggingFace checkpoint.

Gantry copies this file to <repository>/<model>/1/model.py. The config.pbtxt
parameters say what to do:
- task "embed": TEXT (strings) in, EMBEDDING and NUM_TOKENS (per text) out: tokens run through the
  encoder, mean-pooled over real tokens, L2-normalized (the recipe
  sentence-transformers uses for all-MiniLM-L6-v2 and its kin).
- task "rerank": QUERY (one string) and PASSAGES (strings) in, SCORES (one per
  passage) and NUM_TOKENS (all pairs together) out. A cross-encoder checkpoint (*ForSequenceClassification)
  scores each (query, passage) pair; a bi-encoder scores by the cosine of the
  pooled embeddings.
Also checkpoint_path, max_length and, on a GPU instance, gpu_memory_fraction,
which caps this process's PyTorch allocations on that GPU.
"""

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer


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
        self.max_length = int(_parameter(config, "max_length", "256"))
        if args.get("model_instance_kind") == "GPU":
            device_id = int(args["model_instance_device_id"])
            fraction = float(_parameter(config, "gpu_memory_fraction", "0.1"))
            torch.cuda.set_per_process_memory_fraction(fraction, device=device_id)
            self.device = torch.device(f"cuda:{device_id}")
        else:
            self.device = torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        architectures = AutoConfig.from_pretrained(checkpoint).architectures or []
        self.cross_encoder = any(a.endswith("ForSequenceClassification") for a in architectures)
        loader = AutoModelForSequenceClassification if self.cross_encoder else AutoModel
        self.model = loader.from_pretrained(checkpoint).to(self.device).eval()
        pb_utils.Logger.log_info(
            f"{self.task} model {checkpoint} on {self.device} (torch {torch.__version__}, numpy {np.__version__})"
        )

    def execute(self, requests):
        if self.task == "rerank":
            return [self._rerank(request) for request in requests]
        texts_per_request = [_strings(request, "TEXT") for request in requests]
        flat = [text for texts in texts_per_request for text in texts]
        embeddings, counts = self._embed(flat)
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
            encoded = self._tokenize([query] * len(passages), passages)
            with torch.inference_mode():
                logits = self.model(**encoded).logits
            scores = logits[:, -1] if logits.shape[-1] > 1 else logits.squeeze(-1)
            scores = scores.float().cpu().numpy()
            tokens = int(encoded["attention_mask"].sum())
        else:
            vectors, counts = self._embed([query, *passages])
            scores = vectors[1:] @ vectors[0]
            tokens = int(counts.sum())
        outputs = [
            pb_utils.Tensor("SCORES", scores.astype(np.float32).reshape(1, -1)),
            pb_utils.Tensor("NUM_TOKENS", np.array([[tokens]], dtype=np.int32)),
        ]
        return pb_utils.InferenceResponse(outputs)

    def _tokenize(self, texts, pairs=None):
        return self.tokenizer(
            texts, pairs, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)

    def _embed(self, texts):
        """Unit vectors of ``texts`` and how many tokens each took (for usage)."""
        if not texts:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32), np.zeros(0, dtype=np.int32)
        encoded = self._tokenize(texts)
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        normalized = torch.nn.functional.normalize(pooled, p=2, dim=1)
        counts = encoded["attention_mask"].sum(dim=1).cpu().numpy().astype(np.int32)
        return normalized.float().cpu().numpy().astype(np.float32), counts

    def finalize(self):
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

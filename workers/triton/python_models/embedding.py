"""Triton python-backend model: sentence embeddings from a HuggingFace checkpoint.

Gantry copies this file to <repository>/<model>/1/model.py. The checkpoint
folder, the GPU memory fraction and the token limit come from the model's
config.pbtxt parameters. Texts are tokenized together, run through the
encoder, mean-pooled over their real tokens and L2-normalized, the recipe
sentence-transformers uses for all-MiniLM-L6-v2 and its kin.
"""

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        checkpoint = _parameter(config, "checkpoint_path", None)
        if checkpoint is None:
            raise pb_utils.TritonModelException("parameter checkpoint_path is missing")
        self.max_length = int(_parameter(config, "max_length", "256"))
        if args.get("model_instance_kind") == "GPU":
            device_id = int(args["model_instance_device_id"])
            fraction = float(_parameter(config, "gpu_memory_fraction", "0.1"))
            # Caps PyTorch's caching allocator for this process on this GPU, so
            # models sharing the GPU keep their shares.
            torch.cuda.set_per_process_memory_fraction(fraction, device=device_id)
            self.device = torch.device(f"cuda:{device_id}")
        else:
            self.device = torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModel.from_pretrained(checkpoint).to(self.device).eval()

    def execute(self, requests):
        texts_per_request = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            texts_per_request.append([t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw])
        flat = [text for texts in texts_per_request for text in texts]
        embeddings = self._embed(flat) if flat else np.zeros((0, 0), dtype=np.float32)
        responses = []
        start = 0
        for texts in texts_per_request:
            chunk = embeddings[start : start + len(texts)]
            start += len(texts)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", chunk)]))
        return responses

    def _embed(self, texts):
        encoded = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        normalized = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return normalized.float().cpu().numpy().astype(np.float32)

    def finalize(self):
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

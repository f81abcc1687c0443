"""Triton python-backend model: the tokenizer ends of a TensorRT-LLM ensemble.

Gantry copies this file to <repository>/<model>/1/model.py for the
preprocessing and postprocessing models (workers/triton/config.py). The
config.pbtxt parameters say which end it is:
- task "preprocessing": QUERY (text), REQUEST_OUTPUT_LEN and optional
  STOP_WORDS_DICT (strings) in; INPUT_ID, REQUEST_INPUT_LEN, REQUEST_OUTPUT_LEN,
  OUT_END_ID, OUT_PAD_ID and STOP_WORDS_IDS (the engine's [2, n] stop_words_list:
  the ids of every stop string one after another, then their end offsets) out.
  END_ID and PAD_ID default to the tokenizer's eos and pad tokens.
- task "postprocessing": TOKENS_BATCH ([beams, tokens]) and SEQUENCE_LENGTH
  ([beams]) in; OUTPUT (one text per beam) and NUM_OUTPUT_TOKENS (how many
  tokens this response adds) out.
tokenizer_dir is the HuggingFace checkpoint folder holding the tokenizer.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.task = _parameter(config, "task", "")
        if self.task not in ("preprocessing", "postprocessing"):
            raise pb_utils.TritonModelException(
                f"parameter task must be preprocessing or postprocessing, not {self.task!r}"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(_parameter(config, "tokenizer_dir", None))
        self.skip_special = _parameter(config, "skip_special_tokens", "true") == "true"
        eos = self.tokenizer.eos_token_id
        sep = self.tokenizer.sep_token_id
        self.end_id = eos if eos is not None else (sep if sep is not None else 0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_id

    def execute(self, requests):
        handle = self._preprocess if self.task == "preprocessing" else self._postprocess
        responses = []
        for request in requests:
            try:
                responses.append(handle(request))
            except Exception as exc:  # a bad request fails alone, not the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def _preprocess(self, request):
        # One request is a batch of one: every output carries that batch dimension.
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)[0]
        text = query.decode("utf-8") if isinstance(query, bytes) else str(query)
        ids = np.array([self.tokenizer.encode(text)], dtype=np.int32)
        output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().reshape(1, 1)
        end_id = _optional(request, "END_ID")
        pad_id = _optional(request, "PAD_ID")
        stops = _optional(request, "STOP_WORDS_DICT")
        tensors = [
            pb_utils.Tensor("INPUT_ID", ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[ids.shape[1]]], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.astype(np.int32)),
            pb_utils.Tensor("OUT_END_ID", np.array([[self.end_id]] if end_id is None else end_id, dtype=np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", np.array([[self.pad_id]] if pad_id is None else pad_id, dtype=np.int32)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._stop_words(stops)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _stop_words(self, stops):
        """[1, 2, n]: flattened ids of every stop string, then each one's end offset (-1 padded)."""
        words = (
            [] if stops is None else [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stops.reshape(-1)]
        )
        ids, offsets = [], []
        for word in words:
            if word:
                ids += self.tokenizer.encode(word, add_special_tokens=False)
                offsets.append(len(ids))
        width = max(1, len(ids))
        flat = np.full(width, 0, dtype=np.int32)
        flat[: len(ids)] = ids
        ends = np.full(width, -1, dtype=np.int32)
        ends[: len(offsets)] = offsets
        return np.stack([flat, ends])[None]

    def _postprocess(self, request):
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy().reshape(-1)
        tokens = tokens.reshape(-1, tokens.shape[-1])
        texts = [
            self.tokenizer.decode(beam[: int(length)].tolist(), skip_special_tokens=self.skip_special)
            for beam, length in zip(tokens, lengths, strict=True)
        ]
        output = np.array([texts], dtype=object)  # [batch of one, beams]
        added = np.array([[int(lengths[0]) if lengths.size else 0]], dtype=np.int32)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("OUTPUT", output), pb_utils.Tensor("NUM_OUTPUT_TOKENS", added)]
        )

"""What Gantry knows of the projects it drives, without Django: TensorRT-LLM's
releases and command lines (trtllm), a HuggingFace checkpoint's files
(checkpoints) and its chat template (chat_template). Below every app, beside
triton_server and common: the control plane, the gateway and the hosts read
them alike."""

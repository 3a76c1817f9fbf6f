"""Instruction rewriting: a short request (+ the source image) -> the prompt the model was trained on.

HiDream-E1-Full was trained on `Editing Instruction: ... Target Image Description: ...` prompts;
upstream's demo refines a user's short request with a vision-language model first. Two back ends:

* ``openai_backend``: any OpenAI-compatible chat-completions server with image input (vLLM, Ollama,
  MindIE, a cloud endpoint): sees the image, disambiguates, describes source and target.
* ``local_backend``: the Llama-3.1-8B-Instruct the model already holds as a text encoder, plus its
  LM head (loaded only for this): text only, so it reformats and expands, nothing more.

``prompt`` holds the instructions sent, the strict parser of the answers and `RewriteResult`;
``service`` picks the back end from the config and caches answers. Nothing here imports torch,
openai or gradio at import time.
"""

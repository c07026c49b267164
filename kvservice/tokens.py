"""Turning a prompt or a chat into token ids the way the engine does.

* :class:`LocalTokenizer`: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package) and,
  for chats, the ``chat_template`` of ``tokenizer_config.json`` (rendered with ``jinja2``) —
  both from the optional ``service`` extra (``pip install 'kvevents[service]'``);
* :class:`RemoteTokenizer`: asks a pod's ``/tokenize`` endpoint (vLLM serves it; so does the
  simulated engine), trying the pods in turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvevents.errors import ConfigError

from .schema import ApiError

__all__ = ["LocalTokenizer", "RemoteTokenizer", "TokenizerBase"]


class TokenizerBase:
    async def encode(self, model: str, prompt: str | None = None, messages: list | None = None,
                     add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class LocalTokenizer(TokenizerBase):
    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the 'tokenizers' package: pip install 'kvevents[service]' "
                              "(or leave --tokenizer out to ask the pods' /tokenize)") from None
        p = Path(path)
        tj = p / "tokenizer.json" if p.is_dir() else p
        if not tj.is_file():
            raise ConfigError(f"--tokenizer {str(path)!r}: no tokenizer.json there")
        try:
            self.tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # noqa: BLE001 — the library raises plain Exceptions
            raise ConfigError(f"--tokenizer {str(tj)!r}: cannot load it: {exc}") from None
        self.template = None
        self.special: dict[str, str] = {}
        cfg_path = tj.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{cfg_path}: not valid JSON: {exc}") from None
            for k in ("bos_token", "eos_token"):
                v = cfg.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    self.special[k] = v
            tmpl = cfg.get("chat_template")
            if isinstance(tmpl, str):
                try:
                    import jinja2
                    from jinja2.sandbox import ImmutableSandboxedEnvironment
                except ImportError:
                    raise ConfigError("a chat template needs the 'jinja2' package: pip install "
                                      "'kvevents[service]'") from None
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                try:
                    self.template = env.from_string(tmpl)
                except jinja2.TemplateError as exc:
                    raise ConfigError(f"{cfg_path}: chat_template does not compile: {exc}") from None

    def render_chat(self, messages: list, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise ApiError(400, "messages: the tokenizer has no chat_template (tokenizer_config.json)", "messages")
        msgs = [m if isinstance(m, dict) else msgspec.structs.asdict(m) for m in messages]
        try:
            return self.template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **self.special)
        except Exception as exc:  # noqa: BLE001 — a template may raise anything (raise_exception)
            raise ApiError(400, f"messages: the chat template rejected them: {exc}", "messages") from None

    def encode_sync(self, prompt: str | None = None, messages: list | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        if messages is not None:
            return self.tok.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids
        return self.tok.encode(prompt or "").ids

    async def encode(self, model: str, prompt: str | None = None, messages: list | None = None,
                     add_generation_prompt: bool = True) -> list[int]:
        return self.encode_sync(prompt, messages, add_generation_prompt)


class RemoteTokenizer(TokenizerBase):
    """POST ``{url}/tokenize`` of the first pod (of the model) that answers."""

    def __init__(self, urls_by_model: dict[str, list[str]], timeout: float = 10.0) -> None:
        self.urls = urls_by_model
        self.timeout = timeout
        self._session = None
        self.failures = 0

    async def _client(self):
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def encode(self, model: str, prompt: str | None = None, messages: list | None = None,
                     add_generation_prompt: bool = True) -> list[int]:
        import aiohttp

        urls = self.urls.get(model) or []
        if not urls:
            raise ApiError(400, f"model: no pod of model {model!r} has an http URL to tokenize with, and no "
                           "--tokenizer was given", "model")
        body: dict = {"model": model}
        if messages is not None:
            body["messages"] = [m if isinstance(m, dict) else msgspec.structs.asdict(m) for m in messages]
            body["add_generation_prompt"] = add_generation_prompt
        else:
            body["prompt"] = prompt or ""
        session = await self._client()
        last = ""
        for url in urls:
            try:
                async with session.post(f"{url}/tokenize", data=msgspec.json.encode(body),
                                        headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                    if resp.status == 200:
                        tokens = msgspec.json.decode(data).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
                    last = f"{url}/tokenize answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, AttributeError) as exc:
                last = f"{url}/tokenize: {type(exc).__name__}: {exc}"
            self.failures += 1
        raise ApiError(502, f"prompt: no pod could tokenize it ({last})", "prompt", "upstream_error")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

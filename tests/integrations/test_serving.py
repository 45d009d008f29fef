"""``h2o-compile serve``: the real server (transformers' own, uvicorn) in a subprocess on a free port of 127.0.0.1,
talked to with the real ``openai`` client and plain HTTP (the standard library's): answers equal
``optimize(...).generate`` for the same prompt and settings, streamed or not, alone or with 16 clients at once; a
client that leaves mid-stream frees its row; bad requests get a 4xx with a message and the server goes on serving.
Every request has a timeout and every loop a bound. The model: the shipped one (trained weights) with a plain chat
template, 4 rows of 16 slots, so answers of 40 tokens evict."""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import h2o_compile  # noqa: E402
from h2o_compile.bench.serve_http import free_port, running_server  # noqa: E402
from h2o_compile.zoo.loading import TINY_LLAMA_DIR  # noqa: E402

ROWS, BUDGET, MAX_SEQ_LEN = 4, 16, 1000
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["The old prince", "Pierre looked at", "In the morning the", "She said that she", "Natasha ran into the",
           "The army moved", "Anna Pavlovna", "He did not know"]
TIMEOUT = 60


def post(url: str, body) -> tuple[int, str]:
    """(status, text) of a POST of ``body`` (a dict as JSON, or raw bytes)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    shutil.copytree(TINY_LLAMA_DIR, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    """(base url, model name): the server running in a subprocess until the module's tests end."""
    port = free_port()
    command = [sys.executable, "-m", "h2o_compile.cli", "serve", "--model", str(model_dir), "--budget", str(BUDGET),
               "--max-batch-size", str(ROWS), "--max-seq-len", str(MAX_SEQ_LEN), "--port", str(port),
               "--compile", "off", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with running_server(command, url, startup_s=120):
        yield url, str(model_dir)


@pytest.fixture(scope="module")
def offline(model_dir):
    """(optimized model, tokenizer) with the server's settings, for the answers it must give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return h2o_compile.optimize(model, budget=BUDGET, compile=False), AutoTokenizer.from_pretrained(model_dir)


def expected(offline, ids, new_tokens):
    opt, tokenizer = offline
    out = opt.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def test_completion_and_stream_equal_offline_generation(server, offline):
    tokenizer = offline[1]
    ids = tokenizer(PROMPTS[0]).input_ids
    want = expected(offline, ids, 40)
    answer = client(server).completions.create(model=server[1], prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 40
    assert answer.choices[0].text == want
    stream = client(server).completions.create(model=server[1], prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                               stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == want


def test_chat_and_chat_stream_equal_offline_generation(server, offline):
    messages = [{"role": "user", "content": "Tell me of the war."}]
    ids = offline[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    want = expected(offline, list(ids["input_ids"]), 30)
    answer = client(server).chat.completions.create(model=server[1], messages=messages, max_tokens=30,
                                                    temperature=0)
    assert answer.choices[0].message.content == want
    stream = client(server).chat.completions.create(model=server[1], messages=messages, max_tokens=30,
                                                    temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == want


def test_sixteen_clients_at_once_each_get_their_own_answer(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    want = [expected(offline, offline[1](p).input_ids, 24) for p in prompts]

    def ask(prompt):
        return client(server).completions.create(model=server[1], prompt=prompt, max_tokens=24,
                                                 temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == want


def test_a_client_that_leaves_mid_stream_frees_its_row(server):
    """Fill the 4 rows with long streams, drop one after its first tokens: a short request then finishes while
    the other three still stream (had the row stayed taken, it would wait for one of them to end)."""
    done: dict[int, float] = {}
    started = threading.Barrier(ROWS + 1, timeout=TIMEOUT)

    host, port = server[0].removeprefix("http://").split(":")

    def long_stream(i, leave):
        connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        body = {"model": server[1], "prompt": PROMPTS[i], "max_tokens": 900, "temperature": 0, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        while not response.readline().startswith(b"data:"):
            pass
        started.wait()
        if leave:
            connection.close()
            return
        for _ in range(2000):  # 900 tokens: one data line and one blank line each, then [DONE]
            if not response.readline():
                break
        connection.close()
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=long_stream, args=(i, i == 0)) for i in range(ROWS)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(0.5)  # the server notices the closed connection
    short = client(server).completions.create(model=server[1], prompt=PROMPTS[5], max_tokens=4, temperature=0)
    short_done = time.perf_counter()
    for thread in threads:
        thread.join(TIMEOUT * 2)
    assert short.choices[0].finish_reason == "length"
    assert sorted(done) == [1, 2, 3] and all(t > short_done for t in done.values())


@pytest.mark.parametrize("body,status,said", [
    ({"prompt": "x", "max_tokens": -3}, 400, "max_new_tokens"),
    ({"prompt": "x", "max_tokens": 10 ** 6}, 400, "max_seq_len=1000"),
    ({"prompt": "word " * 1000, "max_tokens": 4}, 400, "max_seq_len=1000"),  # within the model's 1024
    ({"model": "no-such-model", "prompt": "x", "max_tokens": 4}, 400, "pinned"),
    ({"messages": [], "max_tokens": 4}, 400, "empty conversation"),
], ids=["negative-max-tokens", "huge-max-tokens", "prompt-past-the-rows", "unknown-model", "empty-messages"])
def test_bad_requests_get_4xx_with_a_message_and_the_server_goes_on(server, offline, body, status, said):
    path = "chat/completions" if "messages" in body else "completions"
    code, text = post(f"{server[0]}/v1/{path}", {"model": server[1], **body})
    message = str(json.loads(text)["detail"])
    assert code == status and said in message and len(message) > 10, message
    answer = client(server).completions.create(model=server[1], prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected(offline, offline[1](PROMPTS[1]).input_ids, 8)


def test_malformed_json_is_a_422_and_failing_requests_leave_the_others_equal(server, offline):
    code, text = post(f"{server[0]}/v1/completions", b"{not json")
    assert code == 422 and "JSON" in text

    def good(prompt):
        return client(server).completions.create(model=server[1], prompt=prompt, max_tokens=20,
                                                 temperature=0).choices[0].text

    def bad(_):
        return post(f"{server[0]}/v1/completions", {"model": server[1], "prompt": "x", "max_tokens": 5000})[0]

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, p) for p in PROMPTS[:4]]
        bads = [pool.submit(bad, i) for i in range(4)]
        assert [b.result() for b in bads] == [400] * 4
        assert [g.result() for g in goods] == [expected(offline, offline[1](p).input_ids, 20) for p in PROMPTS[:4]]

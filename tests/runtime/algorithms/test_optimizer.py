"""The trainer's optimizer: Adam's weights bit for bit, without importing ``torch._dynamo``.

Each check runs in a fresh interpreter: the test process may have imported ``torch._dynamo``
already (then ``EagerAdam`` rightly defers to torch's own methods, and nothing is shown).
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, torch
from rolloutrun_runtime.algorithms.optimizer import build_optimizer

def train(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = make(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        optimizer.step()
    resumed = make(model.parameters())  # a restore: a new optimizer loads the saved state
    resumed.load_state_dict(optimizer.state_dict())
    resumed.zero_grad()
    model(torch.randn(5, 8)).pow(2).sum().backward()
    resumed.step()
    return [p.detach().clone() for p in model.parameters()], resumed.state_dict()

eager, eager_state = train(lambda params: build_optimizer(params, 0.01))
dynamo_after_eager = "torch._dynamo" in sys.modules
adam, adam_state = train(lambda params: torch.optim.Adam(params, lr=0.01))
same_state = all(
    torch.equal(eager_state["state"][k][name], adam_state["state"][k][name])
    for k in adam_state["state"] for name in adam_state["state"][k]
)
print(json.dumps({
    "dynamo_after_eager": dynamo_after_eager,
    "dynamo_after_adam": "torch._dynamo" in sys.modules,
    "same_weights": all(torch.equal(a, b) for a, b in zip(eager, adam)),
    "same_state": same_state and eager_state["param_groups"] == adam_state["param_groups"],
}))
"""


def test_eager_adam_trains_as_adam_without_importing_dynamo() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "dynamo_after_eager": False,
        "dynamo_after_adam": True,  # torch's Adam does import it: the check can see it
        "same_weights": True,
        "same_state": True,
    }

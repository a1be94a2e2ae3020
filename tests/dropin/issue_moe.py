"""The MoE program from the issue, verbatim (inputs dense, gates sparse), against the same computation with
dense gates under plain torch."""

DTYPE = "float32"
SPARSE_KEYS = ()
SCORCH_OPS = ()

# exactly as reported; executed as it stands under scorch (after seeding torch's generator)
PROGRAM = '''\
import scorch as torch
from scorch.nn import functional as F
B, D_in, D_out, N_experts = 64, 32, 16, 8
x = torch.randn(B, D_in)
E = torch.randn(N_experts, D_in, D_out)
gates = torch.rand(B, N_experts)
gates = F.one_hot(gates.argmax(1), N_experts).to_sparse()
x_dispatch = torch.rearrange(x, "bd->bnd", n=N_experts)
y_experts = torch.einsum("bnd,ndh->bnh", x_dispatch, E)
y = torch.einsum("bnd,bn->bd", y_experts, gates)
'''


def run(torch):
    """The issue's program under scorch (``torch`` is scorch here; the program imports it itself)."""
    torch.manual_seed(0)
    ns = {}
    exec(compile(PROGRAM, "issue_moe", "exec"), ns)
    return {"x": ns["x"], "y_experts": ns["y_experts"], "y": ns["y"]}


def reference(torch):
    """The same under plain torch: dense gates, ``rearrange`` spelled with ``expand``. torch's einsum does not
    promote, so the integer one-hot gates are cast to the experts' dtype."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    B, D_in, D_out, N_experts = 64, 32, 16, 8
    x = torch.randn(B, D_in)
    E = torch.randn(N_experts, D_in, D_out)
    gates = torch.rand(B, N_experts)
    gates = F.one_hot(gates.argmax(1), N_experts)
    x_dispatch = x.unsqueeze(1).expand(B, N_experts, D_in)
    y_experts = torch.einsum("bnd,ndh->bnh", x_dispatch, E)
    y = torch.einsum("bnd,bn->bd", y_experts, gates.to(y_experts.dtype))
    return {"x": x, "y_experts": y_experts, "y": y}


# the program followed by what a model does with its output: a loss, backward() and an optimizer step (the experts
# a Parameter); under scorch it must run with no warning and no dense fallback
STEP = '''\
target = torch.randn(B, D_out)
opt = torch.optim.SGD([E], lr=0.1, momentum=0.9)
loss = F.mse_loss(y, target)
loss.backward()
grad = E.grad.clone()
opt.step()
'''
TRAINING = PROGRAM.replace("E = torch.randn(N_experts, D_in, D_out)",
                           "E = torch.nn.Parameter(torch.randn(N_experts, D_in, D_out))") + STEP


def train(torch):
    """The training step under scorch (``torch`` is scorch here)."""
    torch.manual_seed(0)
    ns = {}
    exec(compile(TRAINING, "issue_moe_training", "exec"), ns)
    return {"y": ns["y"], "loss": ns["loss"], "grad": ns["grad"], "E": ns["E"]}


def train_reference(torch):
    """The same step under plain torch, dense gates."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    B, D_in, D_out, N_experts = 64, 32, 16, 8
    x = torch.randn(B, D_in)
    E = torch.nn.Parameter(torch.randn(N_experts, D_in, D_out))
    gates = F.one_hot(torch.rand(B, N_experts).argmax(1), N_experts)
    y = torch.einsum("bnd,bn->bd", torch.einsum("bd,ndh->bnh", x, E), gates.to(E.dtype))
    ns = {"torch": torch, "F": F, "B": B, "D_out": D_out, "y": y, "E": E}
    exec(compile(STEP, "issue_moe_step", "exec"), ns)  # the same step as the program's
    return {"y": y, "loss": ns["loss"], "grad": ns["grad"], "E": E}

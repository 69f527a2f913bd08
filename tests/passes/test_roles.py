"""roles.role: which product of an input with a weight is an attention's value projection
or an MLP's output projection, read from an ATen graph's structure."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.passes import roles

aten = torch.ops.aten


class Block(torch.nn.Module):
    """A decoder layer as the models write it: norm, q/k/v, attention, o; norm, a gated
    MLP (gate, up, down) or a stack of linears and activations."""

    def __init__(self, gated=True):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.gated = gated
        self.gate, self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = F.rms_norm(x, (32,))
        q, k, v = (p(h).view(1, -1, 2, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, -1, 32))
        h = F.rms_norm(x, (32,))
        # Not gated: gate -> gelu -> up -> relu -> down, a stack whose last linear only goes back to x.
        inner = F.gelu(self.gate(h)) * self.up(h) if self.gated else F.relu(self.up(F.gelu(self.gate(h))[..., :32]))
        return x + self.down(inner)


def roles_of(model):
    """{linear name: role} over the products of `model`'s ATen graph, in call order."""
    gm = make_fx(model)(torch.randn(1, 5, 32))
    products = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    names = ["q", "k", "v", "o", "gate", "up", "down"]
    return dict(zip(names, (roles.role(n, set(products), set()) for n in products)))


def test_the_value_and_the_gated_mlps_down_projection_are_found():
    assert roles_of(Block().eval()) == {"q": None, "k": None, "v": roles.VALUE, "o": None, "gate": None,
                                        "up": None, "down": roles.MLP_OUTPUT}


def test_in_a_stack_of_linears_only_the_last_is_the_mlps_output():
    """up reads gate's result through an activation but its own result reaches down: a hidden
    layer, not the MLP's output."""
    assert roles_of(Block(gated=False).eval()) == {"q": None, "k": None, "v": roles.VALUE, "o": None,
                                                   "gate": None, "up": None, "down": roles.MLP_OUTPUT}


def test_a_product_that_reaches_attention_as_query_or_key_too_is_not_the_value():
    """A fused q/k/v product reaches attention in every slot: it is not the value projection,
    so under int4 it keeps int4 (quantize.role_formats)."""

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96, bias=False)

        def forward(self, x):
            q, k, v = (t.view(1, -1, 2, 16).transpose(1, 2) for t in self.qkv(x).split(32, -1))
            return F.scaled_dot_product_attention(q, k, v)

    gm = make_fx(Fused().eval())(torch.randn(1, 5, 32))
    (mm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert roles.role(mm, {mm}, set()) is None

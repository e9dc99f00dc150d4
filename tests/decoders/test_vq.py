"""VQ tokenizer: shapes, nearest-code search against a float64 reference, training lowers the
reconstruction error, weights round-trip, and parity with Hugging Face's JanusVQVAE."""

import pytest
import torch
import torch.nn.functional as F

from tests.encoders.hf_utils import (
    check_init_covers_everything,
    load_with_adapter,
    randomize_,
    rel_err,
)
from torchtitan_omni.decoders.vq import (
    Quantizer, VQArgs, VQTokenizer, load_vq, read_vq_args, restart_dead_codes, save_vq,
)
from torchtitan_omni.modules.init import init_context


def tiny_args(**kw) -> VQArgs:
    base = dict(
        image_size=16,
        base_channels=16,
        channel_mult=(1, 2),
        num_res_blocks=1,
        z_channels=16,
        codebook_size=64,
        codebook_dim=4,
        norm_groups=4,
    )
    base.update(kw)
    return VQArgs(**base)


def build(args=None, seed=0) -> VQTokenizer:
    vq = VQTokenizer(args or tiny_args())
    with init_context(vq, seed=seed):
        vq.init_weights()
    return vq


def digits(n: int, size: int = 16) -> torch.Tensor:
    """Real handwritten digits (scikit-learn), upsampled to ``size`` px RGB in [-1, 1]."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images[:n], dtype=torch.float32) / 16.0
    x = F.interpolate(x[:, None], size=(size, size), mode="bilinear", align_corners=False)
    return (x * 2 - 1).expand(-1, 3, -1, -1).contiguous()


def test_encode_decode_shapes_and_errors():
    vq = build()
    pixels = torch.rand(3, 3, 16, 16) * 2 - 1
    codes = vq.encode(pixels)
    assert codes.shape == (3, 64) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < 64
    assert vq.decode(codes).shape == (3, 3, 16, 16)
    assert vq.args.downsample == 2 and vq.args.grid == 8
    with pytest.raises(ValueError, match="square grid"):
        vq.decode(codes[:, :10])
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 64\)"):
        vq.decode(codes + 64)
    with pytest.raises(ValueError, match="not a multiple of the downsampling"):
        vq.encode(torch.zeros(1, 3, 15, 15))
    check_init_covers_everything(VQTokenizer(tiny_args()))


@pytest.mark.parametrize("l2_norm", [True, False])
def test_nearest_code_matches_float64_reference(l2_norm):
    q = Quantizer(tiny_args(l2_norm=l2_norm, codebook_size=300))
    torch.nn.init.normal_(q.codebook.weight)
    q.chunk = 7  # exercise the blocked search
    z = torch.randn(2, 4, 5, 5)
    out = q(z)
    zf = z.permute(0, 2, 3, 1).reshape(-1, 4).double()
    e = q.codebook.weight.double()
    if l2_norm:
        zf, e = F.normalize(zf, dim=-1), F.normalize(e, dim=-1)
    ref = torch.cdist(zf, e).argmin(-1)
    assert torch.equal(out.codes.flatten(), ref)
    # straight-through: the forward value is the code vector, the gradient reaches z
    assert torch.allclose(out.z_q.permute(0, 2, 3, 1).reshape(-1, 4).double(), e[ref], atol=1e-6)


def test_training_steps_reduce_reconstruction_error():
    torch.manual_seed(0)
    vq = build()
    train = digits(8)
    opt = torch.optim.Adam(vq.parameters(), lr=3e-3)

    def mse() -> float:
        with torch.no_grad():
            return float(F.mse_loss(vq.decode(vq.encode(train)), train))

    before = mse()
    usage = torch.zeros(vq.args.codebook_size)
    for step in range(20):
        out = vq(train, op="train")
        loss = out.l1 + out.l2 + out.codebook_loss + vq.args.commitment * out.commitment_loss
        opt.zero_grad()
        loss.backward()
        if step == 0:  # straight-through: the reconstruction alone reaches the encoder
            assert vq.encoder.conv_in.weight.grad.abs().sum() > 0
        opt.step()
        usage += torch.bincount(out.codes.flatten(), minlength=usage.numel())
        if step % 10 == 9:
            restart_dead_codes(vq.quantizer, usage, out.z_flat.detach())
            usage.zero_()
    after = mse()
    assert after < 0.5 * before, (before, after)


def test_save_and_load_round_trip(tmp_path):
    vq = build(seed=1)
    path = str(tmp_path / "vq")
    save_vq(vq, path, extra={"psnr": "12.3"})
    assert read_vq_args(path) == vq.args
    other = build(seed=2)
    load_vq(other, path)
    pixels = torch.rand(2, 3, 16, 16) * 2 - 1
    assert torch.equal(other.encode(pixels), vq.encode(pixels))
    with pytest.raises(ValueError, match="holds a VQ of shape"):
        load_vq(build(tiny_args(codebook_size=32)), path)


def test_matches_hf_janus_vqvae(tmp_path):
    from safetensors.torch import save_file
    from transformers.models.janus.configuration_janus import JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import JanusVQVAE

    from torchtitan_omni.decoders.hf import JanusVQAdapter

    # GroupNorm has 32 groups in HF's port: the smallest widths are 32.
    args = tiny_args(
        base_channels=32, channel_mult=(1, 2), z_channels=32, norm_groups=32, image_size=8
    )
    cfg = JanusVQVAEConfig(embed_dim=4, num_embeddings=64, latent_channels=32, base_channels=32,
                           channel_multiplier=[1, 2], num_res_blocks=1, num_patches=4)
    torch.manual_seed(0)
    hf = randomize_(JanusVQVAE(cfg), seed=1).eval()
    path = tmp_path / "model.safetensors"
    save_file({f"model.vqmodel.{k}": v.contiguous() for k, v in hf.state_dict().items()}, str(path))

    vq = VQTokenizer(args)
    missing, unused = load_with_adapter(vq, JanusVQAdapter(args, list(vq.state_dict())), path)
    assert missing == set() and unused == set()

    pixels = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1
    codes = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_latents = hf.quant_conv(hf.encoder(pixels))
        assert rel_err(vq.encoder(pixels), ref_latents) < 1e-5
        assert rel_err(vq.decode(codes), hf.decode(codes)) < 1e-5
        # LlamaGen's code choice: the largest cosine between latent and code
        zf = F.normalize(ref_latents.permute(0, 2, 3, 1).reshape(-1, 4).double(), dim=-1)
        e = F.normalize(hf.quantize.embedding.weight.double(), dim=-1)
        assert torch.equal(vq.encode(pixels).flatten(), (zf @ e.t()).argmax(-1))

"""What users bring that disttrain's own modules do not look like: Lightning's GAN pattern (two sub-networks, two
optimizers, manual optimization) and a timm classifier, with their data. Imported by tests/dist/user_loops.py
(2 processes) and by tests/test_user_models.py (one process, to load the checkpoints that run wrote)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LATENT, DATA_DIM = 8, 12
MICRO_BATCH, STEPS, WORLD = 4, 4, 2  # 4 batches per rank: one epoch of 4 manual steps


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Generator(nn.Module):
    """Layers outside any repeated block (``inp``, ``out``) and two identical blocks (FSDP units of their own)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(LATENT, hidden)
        self.blocks = nn.ModuleList([Residual(hidden) for _ in range(2)])
        self.out = nn.Linear(hidden, DATA_DIM)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(z))
        for block in self.blocks:
            h = block(h)
        return torch.tanh(self.out(h))


def discriminator(hidden: int = 32) -> nn.Module:
    """No repeated block at all: every parameter lies outside the blocks FSDP finds."""
    return nn.Sequential(nn.Linear(DATA_DIM, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))


def gan_data() -> TensorDataset:
    """(real sample, latent) pairs: the noise comes with the data, so every strategy sees the same inputs."""
    g = torch.Generator().manual_seed(4321)
    n = MICRO_BATCH * WORLD * STEPS
    real = torch.tanh(torch.randn(n, DATA_DIM, generator=g) * 0.5 + torch.linspace(-1, 1, DATA_DIM))
    return TensorDataset(real, torch.randn(n, LATENT, generator=g))


def gan_loader(shuffle: bool = True) -> DataLoader:
    return DataLoader(gan_data(), batch_size=MICRO_BATCH, shuffle=shuffle)


def probe_latent() -> torch.Tensor:
    return torch.randn(5, LATENT, generator=torch.Generator().manual_seed(99))


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def adversarial_losses(generator, disc, real: torch.Tensor, z: torch.Tensor):
    """The two losses of one step; each is a separate function so both entry points share the maths."""
    valid, fake = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)

    def g_loss() -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(disc(generator(z)), valid)

    def d_loss() -> torch.Tensor:
        real_loss = F.binary_cross_entropy_with_logits(disc(real), valid)
        fake_loss = F.binary_cross_entropy_with_logits(disc(generator(z).detach()), fake)
        return (real_loss + fake_loss) / 2

    return g_loss, d_loss


class GAN(L.LightningModule):
    """Lightning's basic GAN example, shape for shape: ``automatic_optimization = False``, the generator and
    discriminator as attributes, toggle/untoggle around two ``manual_backward`` calls per step."""

    def __init__(self, hidden: int = 32, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(hidden)
        self.discriminator = discriminator(hidden)
        self.g_losses: list[float] = []
        self.d_losses: list[float] = []

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_g, opt_d = self.optimizers()
        g_loss, d_loss = adversarial_losses(self, self.discriminator, real, z)

        self.toggle_optimizer(opt_g)
        loss_g = g_loss()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        loss_d = d_loss()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.g_losses.append(mean_over_ranks(loss_g))
        self.d_losses.append(mean_over_ranks(loss_d))
        self.log_dict({"g_loss": loss_g, "d_loss": loss_d})

    def configure_optimizers(self):
        lr = self.hparams.lr
        return (torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999)))


class Pair(nn.Module):
    """Fabric's one-module form: both networks in one container set up by one ``fabric.setup``."""

    def __init__(self, generator: nn.Module, disc: nn.Module) -> None:
        super().__init__()
        self.generator = generator
        self.discriminator = disc

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)


# -- a timm classifier (no BatchNorm: ConvNeXt's LayerNorm keeps the ranks' state equal) -------------------------
N_CLASSES, IMAGE = 5, 32


def tiny_convnext(seed: int = 0) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model("convnext_atto", pretrained=False, num_classes=N_CLASSES, dims=(16, 24, 32, 48),
                             depths=(1, 1, 2, 1))


def image_data() -> TensorDataset:
    g = torch.Generator().manual_seed(77)
    n = MICRO_BATCH * WORLD * 2
    return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g))


def probe_images() -> torch.Tensor:
    return torch.randn(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(5))


class Classifier(L.LightningModule):
    """A plain image classifier: ``self.model`` is the timm network, loss in ``training_step``."""

    def __init__(self, arch: str = "convnext_atto", lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_convnext()
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.losses.append(mean_over_ranks(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


# -- a peft-wrapped Hugging Face model, saved with save_pretrained after fit ---------------------------------------
VOCAB, SEQ = 64, 8


def tiny_qwen2(seed: int = 0) -> nn.Module:
    """A Qwen2 of two layers with tied embeddings (as the small Qwen2 checkpoints have), seeded: the frozen base a
    fresh process rebuilds to load the saved adapters into."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)


def token_data(n: int = MICRO_BATCH * STEPS * WORLD) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3)))


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


class PeftLM(L.LightningModule):
    """A language model as peft's docs wrap one: ``self.model = get_peft_model(base, LoraConfig(...))``."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        from peft import get_peft_model

        self.lr = lr
        self.model = get_peft_model(tiny_qwen2(), lora_config())
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(mean_over_ranks(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

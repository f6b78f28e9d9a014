"""DP-SGD noise in a public gradient subspace.

DP-SGD noises every trainable number: the noise on a step grows as the
square root of their count while the clipped signal does not, so with
30,000 bias terms the noise on a site's averaged step is 15 times the
signal (docs/results.md, "Private models"). Gradients of a fine-tuned
model mostly lie in a subspace of far lower dimension, and that subspace
can be found on public text (Zhou et al. 2021, "Bypassing the ambient
dimension: private SGD with gradient subspace identification"; Yu et al.
2021, "Do not let privacy overbill utility: gradient embedding
perturbation").

A :class:`GradientSubspace` holds an orthonormal basis ``V`` (``rank`` rows)
over the trainable tensors, found on public text at the starting model:
the top principal directions of per-example gradients of the encoder's
tensors, and for a linear head every label paired with the top principal
directions of the tokens' features (:func:`label_feature_basis`, so the
types public text never labels still learn); tensors outside it (the
head's bias) are kept whole. Each DP-SGD step then
releases ``V S + z`` (and the kept tensors' sums plus noise) instead of
``S + z`` for the step's sum of clipped gradients ``S``, and steps on
``V^T (V S + z)``.

Privacy is unchanged: ``V`` has orthonormal rows and depends on public text
and the public starting model only, so ``||V g|| <= ||g|| <= C`` for every
clipped per-unit gradient ``g``, and the released vector is the Gaussian
mechanism with the same sensitivity ``C`` and the same noise multiplier
over fewer coordinates; the step taken from it is post-processing. The
accounting (sampling rate, steps, noise multiplier) is the same line by
line. What changes is utility: ``rank + kept`` numbers carry noise instead
of every trainable one, and the part of the private gradient outside the
subspace is dropped.

The dropped part can be kept at a discount instead (``residual`` ``a`` in
``[0, 1]``): the step is then ``V^T V y + a (y - V^T V y)`` for the plain
DP-SGD release ``y = S + z`` over the projected tensors. Since ``V z`` is
``N(0, sigma^2 C^2 I_rank)`` for orthonormal ``V``, the subspace's step is
itself post-processing of that release, and so is every ``a``: the
accounting is plain DP-SGD's, the same as above. ``a = 0`` is the subspace
alone, ``a = 1`` plain DP-SGD; between, the outside part of the gradient
comes back with ``a`` times its noise. (Releasing the outside part with a
larger noise ``r sigma`` instead, as gradient embedding perturbation does
with its own clip, is worse at equal accounting: its signal-to-noise is
``1 / r`` of this one's.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch


def top_directions(gradients: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """The ``rank`` leading right singular vectors of ``gradients``
    (``(examples, dimension)``, one per-example gradient a row), as the rows
    of an orthonormal ``(rank, dimension)`` basis, and the share of the
    gradients' squared norm that basis holds.

    Found from the smaller of the ``examples x examples`` Gram matrix and the
    ``dimension x dimension`` second-moment matrix (in float64), so the
    memory stays near the gradients' own."""
    if gradients.ndim != 2 or gradients.shape[0] == 0:
        raise ValueError("top_directions needs a (examples, dimension) matrix with rows")
    if not 1 <= rank <= min(gradients.shape):
        raise ValueError(
            f"rank {rank} must be between 1 and min(examples, dimension) = {min(gradients.shape)}"
        )
    examples, dimension = gradients.shape
    if dimension <= examples:  # the right singular vectors directly
        moment = (gradients.T @ gradients).double()
        values, vectors = torch.linalg.eigh(moment)  # ascending
        values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
        total = float(values.sum())
        held = float(values[:rank].sum()) / total if total > 0 else 0.0
        return vectors[:, :rank].T.to(gradients.dtype).contiguous(), held
    gram = (gradients @ gradients.T).double()
    values, vectors = torch.linalg.eigh(gram)  # ascending
    values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
    total = float(values.sum())
    held = float(values[:rank].sum()) / total if total > 0 else 0.0
    # v_i = G^T u_i / sqrt(lambda_i), then orthonormalised: directions with a
    # (near) zero singular value come out of the QR as any completing ones.
    directions = vectors[:, :rank].to(gradients.dtype).T @ gradients
    q, _ = torch.linalg.qr(directions.T.double())
    return q.T.to(gradients.dtype).contiguous(), held


def label_feature_basis(features: torch.Tensor, labels: int) -> torch.Tensor:
    """The basis of a linear head's weight ``(labels, hidden)`` whose rows
    are ``e_l x u_j``: every label, paired with each feature direction
    ``u_j`` (the rows of ``features``, ``(rank, hidden)``, orthonormal).

    A token's gradient on the head is ``e h^T`` (label error times the token's
    features): its projection keeps ``e`` whole, so a type the public text
    never labels still learns, and only ``h`` is taken to the public feature
    directions. ``(labels * rank, labels * hidden)``, orthonormal rows."""
    return torch.kron(torch.eye(labels), features)


def stack_blocks(groups: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One basis from bases over disjoint tensors, block-diagonally: each
    group's rows are zero on the other groups' tensors, so orthonormal rows
    per group give orthonormal rows overall."""
    ranks = [next(iter(g.values())).shape[0] if g else 0 for g in groups]
    out: dict[str, torch.Tensor] = {}
    for index, group in enumerate(groups):
        before, after = sum(ranks[:index]), sum(ranks[index + 1 :])
        for name, block in group.items():
            if name in out:
                raise ValueError(f"tensor {name} is in two groups of the basis")
            zeros = block.new_zeros
            out[name] = torch.cat(
                [zeros(before, block.shape[1]), block, zeros(after, block.shape[1])]
            )
    return out


@dataclass
class GradientSubspace:
    """Where DP-SGD's noise goes: ``basis[name]`` is the ``(rank, numel)``
    block of the orthonormal basis for tensor ``name``; tensors in ``kept``
    are noised whole.

    Attributes
    ----------
    basis
        Per projected tensor, its columns of ``V`` (the rows of ``V``,
        concatenated over the tensors in ``names`` order, are orthonormal).
    kept
        Trainable tensors outside the basis, noised coordinate by coordinate.
    held
        Share of the public per-example gradients' squared norm inside the
        basis (a diagnostic; public).
    residual
        Share of the noised gradient outside the basis the step keeps, in
        ``[0, 1]`` (0: none, the subspace alone; 1: plain DP-SGD).
    """

    basis: dict[str, torch.Tensor]
    kept: frozenset[str]
    held: float = 0.0
    residual: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.residual <= 1.0:
            raise ValueError(f"residual {self.residual} must be in [0, 1]")

    @property
    def rank(self) -> int:
        return next(iter(self.basis.values())).shape[0] if self.basis else 0

    def _numbers(self, shapes: Mapping[str, torch.Size]) -> tuple[int, int]:
        """Trainable numbers in the basis's tensors and in the kept ones."""
        numel = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
        projected = sum(v for n, v in numel.items() if n in self.basis)
        return projected, sum(v for n, v in numel.items() if n in self.kept)

    def noised_numbers(self, shapes: Mapping[str, torch.Size]) -> int:
        """How many numbers a step noises for trainable tensors ``shapes``
        (the residual's included when it is kept)."""
        projected, kept = self._numbers(shapes)
        return (projected if self.residual else self.rank) + kept

    def noise_dimensions(self, shapes: Mapping[str, torch.Size]) -> float:
        """The squared norm of the noise on a step, in units of one noised
        number's variance: ``rank + kept`` plus ``residual^2`` per dimension
        outside the basis."""
        projected, kept = self._numbers(shapes)
        return self.rank + kept + self.residual**2 * (projected - self.rank)

    def held_share(self, sums: Mapping[str, torch.Tensor]) -> float:
        """``||V S||^2 / ||S||^2`` over the basis's tensors of ``sums``: the
        share of a step's clipped sum the basis holds (a diagnostic)."""
        projected = [n for n in sums if n in self.basis]
        total = sum(float(sums[n].float().square().sum()) for n in projected)
        if not total:
            return 0.0
        device = sums[projected[0]].device
        coordinates = sum(self._on(n, device) @ sums[n].reshape(-1).float() for n in projected)
        return float(coordinates.square().sum()) / total

    def coordinate_noise(self, shapes: Mapping[str, torch.Size]) -> float:
        """The root-mean-square noise on one trainable number of a step, as
        a share of the noise DP-SGD without the subspace puts on each:
        ``sqrt(noise_dimensions / trainable numbers)``. Optimizers that are
        sized by the noise per coordinate (``--optimizer adambc`` and
        ``sgd``) must use it, or they step as if every number carried the
        full noise."""
        total = sum(int(torch.Size(s).numel()) for s in shapes.values())
        return (self.noise_dimensions(shapes) / total) ** 0.5 if total else 1.0

    def check(self, names: Sequence[str]) -> None:
        """Every trainable tensor must be in the basis or kept whole: a
        tensor in neither would step on nothing the noise covers."""
        unknown = [n for n in names if n not in self.basis and n not in self.kept]
        if unknown:
            raise ValueError(
                f"trainable tensor {unknown[0]} is outside the public gradient subspace: "
                "the subspace was found for other trainable tensors"
            )

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """``basis[name]`` on ``device``, moved there once (every step uses it)."""
        block = self.basis[name]
        if block.device != device:
            block = self.basis[name] = block.to(device)
        return block

    def noisy_gradients(
        self,
        sums: Mapping[str, torch.Tensor],
        noise: Callable[[int], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Each tensor's noised sum, from the step's clipped sums ``sums``.

        ``noise(n)`` draws ``n`` values of ``N(0, (noise_multiplier *
        max_grad_norm)^2)``: ``rank`` for the coordinates in the basis (or,
        with a ``residual``, one per number of the projected tensors), then
        one per number of the kept tensors (in ``sums`` order).
        """
        self.check(list(sums))
        projected = [n for n in sums if n in self.basis]
        kept = [n for n in sums if n in self.kept]
        sizes = [sums[n].numel() for n in kept]
        if self.residual and projected:
            whole = [sums[n].numel() for n in projected]
            drawn = noise(sum(whole) + sum(sizes))
            out = self._with_residual(sums, projected, drawn[: sum(whole)].split(whole))
            rest = drawn[sum(whole) :]
        else:
            drawn = noise(self.rank + sum(sizes))
            out = self._projected(sums, projected, drawn[: self.rank].clone())
            rest = drawn[self.rank :]
        for name, part in zip(kept, rest.split(sizes), strict=True):
            out[name] = sums[name] + part.view_as(sums[name]).to(sums[name].device)
        return out

    def _projected(
        self, sums: Mapping[str, torch.Tensor], projected: list[str], coordinates: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``V^T (V S + z)``: ``coordinates`` holds the noise ``z`` (``rank`` values)."""
        out: dict[str, torch.Tensor] = {}
        if not projected:
            return out
        device = sums[projected[0]].device
        coordinates = coordinates.to(device)
        blocks = {name: self._on(name, device) for name in projected}
        for name in projected:
            coordinates += blocks[name] @ sums[name].reshape(-1).float()
        for name in projected:
            out[name] = (coordinates @ blocks[name]).view_as(sums[name]).to(sums[name].dtype)
        return out

    def _with_residual(
        self,
        sums: Mapping[str, torch.Tensor],
        projected: list[str],
        parts: Sequence[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """``V^T V y + a (y - V^T V y)`` for ``y = S + z`` (``parts``: ``z``
        per projected tensor)."""
        device = sums[projected[0]].device
        released = {
            name: sums[name].reshape(-1).float() + part.to(device)
            for name, part in zip(projected, parts, strict=True)
        }
        blocks = {name: self._on(name, device) for name in projected}
        coordinates = sum(blocks[name] @ released[name] for name in projected)
        out: dict[str, torch.Tensor] = {}
        for name in projected:
            inside = coordinates @ blocks[name]
            step = inside + self.residual * (released[name] - inside)
            out[name] = step.view_as(sums[name]).to(sums[name].dtype)
        return out

"""Secure aggregation: the server learns the sum of the sites' weighted
uploads, never one site's.

The protocol is SecAgg (Bonawitz et al., CCS 2017) over the complete graph
of a round's sites, the form SecAgg+ (Bell et al., CCS 2020) takes at
hospital scale, run as engine stages so that every transport carries it:

1. ``train``: a site trains as usual but keeps its upload; it replies with
   its record, two fresh public keys (one to encrypt shares, one to agree
   masks) and the names it would upload.
2. ``share``: each site learns the others' public keys, draws a secret
   self-mask seed ``b``, splits ``b`` and its mask private key into Shamir
   shares (threshold ``t``) and sends each other site its shares,
   encrypted for it; the server only relays ciphertext.
3. ``mask``: each site sends ``w x + PRG(b) + sum_v +-PRG(s_uv)`` over the
   round's names in fixed point modulo 2^64, ``w`` its number of examples,
   ``x`` its upload (zeros with weight 0 for a name it does not send);
   ``s_uv`` is agreed with each other site, so pairwise masks cancel in the
   sum. Per-name weights travel masked the same way, so the mean stays exact.
4. ``unmask``: each surviving site sends, for every other site, either its
   share of ``b`` (sites whose masked input arrived) or its share of the
   mask key (sites that dropped out after stage 2), never both. With ``t``
   shares the server removes what is left of the masks.

Up to ``n - t`` sites may drop out after stage 1. ``t`` is at least a
majority of the round's sites: a server that told different sites
different stories would need ``2t <= n`` answers to rebuild both secrets
of one site.

Flower's primitives do the key agreement (ECDH on P-384, HKDF),
the share encryption (Fernet) and Shamir's sharing. The masks are not
Flower's ``pseudo_rand_gen``, which folds its seed to 32 bits (a server
could enumerate every mask); they are ChaCha20 keystreams under the full
256-bit key. Quantization is exact fixed point, not Flower's clipping.

This module is the protocol's primitives and a site's stages
(:func:`site_stage`, :func:`hold_upload`); the server's side is
:class:`~clinfed.federated.secure_summation.SecureRound`. It does no I/O except
the site's own state folder (``secure/``, 0700; files 0600, deleted when
the round is answered).
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clinfed.core.errors import ClinfedError

# The masked upload's per-name weights travel under this name.
WEIGHTS = "secure/weights"
# Fixed point: 24 fractional bits (float32 keeps 24 bits of mantissa).
FRACTION_BITS = 24
SCALE = float(1 << FRACTION_BITS)
_CHUNK = 1 << 20  # mask elements generated at a time


# ------------------------------------------------------------------ math
def threshold(sites: int, fraction: float) -> int:
    """Shares needed to rebuild a secret among ``sites``: at least two, at
    least a strict majority, at least ``fraction`` of them."""
    return max(2, sites // 2 + 1, math.ceil(fraction * sites - 1e-9))


def minimum_threshold(sites: int) -> int:
    """The lowest threshold a site accepts, whatever the server says."""
    return threshold(sites, 0.0)


def add_mask(vectors: list[np.ndarray], key: bytes, sign: int) -> None:
    """Add (``sign`` +1) or subtract (-1) the ChaCha20 keystream of ``key``
    to ``vectors`` (flat uint64, modulo 2^64), in their order."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    encryptor = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor()
    zeros = bytes(8 * _CHUNK)
    for vector in vectors:
        for start in range(0, vector.size, _CHUNK):
            part = vector[start : start + _CHUNK]
            stream = np.frombuffer(encryptor.update(zeros[: 8 * part.size]), dtype=np.uint64)
            if sign > 0:
                part += stream
            else:
                part -= stream


def fixed_point(value: torch.Tensor, weight: int) -> np.ndarray:
    """``weight * value`` as flat int64 fixed point, viewed as uint64."""
    scaled = np.rint(value.detach().cpu().to(torch.float64).numpy().ravel() * (weight * SCALE))
    return scaled.astype(np.int64).view(np.uint64)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError("expected base64 text")
    return base64.b64decode(text.encode("ascii"), validate=True)


def _mask_key(shared: bytes) -> bytes:
    # Flower's key agreement returns its 32-byte HKDF output in urlsafe base64.
    return base64.urlsafe_b64decode(shared)


# ------------------------------------------------------------ the server
def _folder(state_dir: Path) -> Path:
    folder = Path(state_dir) / "secure"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _paths(state_dir: Path, round_number: int) -> tuple[Path, Path]:
    folder = _folder(state_dir)
    return folder / f"r{round_number:04d}.json", folder / f"r{round_number:04d}.safetensors"


def forget(state_dir: Path) -> None:
    """Drop every secret the site holds for secure aggregation."""
    shutil.rmtree(Path(state_dir) / "secure", ignore_errors=True)


def _save(path: Path, secrets: dict[str, Any]) -> None:
    from clinfed.core.runs import atomic_write_text

    atomic_write_text(path, json.dumps(secrets))  # mkstemp: 0600


def hold_upload(
    state_dir: Path,
    site: str,
    round_number: int,
    upload: Mapping[str, torch.Tensor],
    weight: int,
) -> dict[str, Any]:
    """Stage 1 at a site: keep the upload, make fresh keys; the public part
    of the reply. Secrets of older rounds are dropped first."""
    from flwr.supercore.primitives.asymmetric import (
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    from clinfed.federated.state import save_tensors

    forget(state_dir)
    secrets_path, upload_path = _paths(state_dir, round_number)
    save_tensors(upload_path, dict(upload))
    public, keys = {}, {}
    for role in ("encrypt", "mask"):
        private_key, public_key = generate_key_pairs()
        keys[role] = _b64(private_key_to_bytes(private_key))
        public[role] = _b64(public_key_to_bytes(public_key))
    _save(
        secrets_path,
        {
            "stage": "train",
            "site": site,
            "weight": int(weight),
            "names": sorted(upload),
            "private": keys,
            "public": public,
        },
    )
    return public | {"names": sorted(upload)}


def site_name(state_dir: Path, round_number: int) -> str:
    """The site that holds the round's secrets (it answers under this name)."""
    return _load(state_dir, round_number, None)["site"]


def _load(state_dir: Path, round_number: int, stage: str | None) -> dict[str, Any]:
    path, _ = _paths(state_dir, round_number)
    try:
        secrets = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        raise ClinfedError(
            f"secure aggregation: no secrets for round {round_number} at this site "
            "(restarted, or answered already)"
        ) from None
    if stage is not None and secrets["stage"] != stage:
        raise ClinfedError(
            f"secure aggregation: round {round_number} is past stage {stage} at this site"
        )
    return secrets


def site_stage(
    state_dir: Path, round_number: int, request: Mapping[str, Any], min_group: int = 2
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Stages 2-4 at a site: the tensors (masked input) and the secure part
    of its reply. Refuses (ClinfedError) whatever would let the server learn
    one site's upload: a group of fewer keys than ``min_group`` (the site's
    own policy: the sites it expects) at any stage, a threshold below a
    majority, a group smaller than it, a site named both survivor and dropout, a second
    unmasking."""
    stage = request.get("stage")
    if stage == "share":
        return {}, _share(state_dir, round_number, request, min_group)
    if stage == "mask":
        return _mask(state_dir, round_number, request)
    if stage == "unmask":
        return {}, _unmask(state_dir, round_number, request)
    raise ClinfedError(f"secure aggregation: unknown stage {stage!r}")


def _share(
    state_dir: Path, round_number: int, request: Mapping[str, Any], min_group: int = 2
) -> dict[str, Any]:
    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
    )

    secrets = _load(state_dir, round_number, "train")
    keys = {int(k): v for k, v in dict(request["keys"]).items()}
    index, t = int(request["index"]), int(request["threshold"])
    if keys.get(index) != secrets["public"]:
        raise ClinfedError("secure aggregation: the server relayed other keys as this site's")
    if len(keys) < min_group:
        raise ClinfedError(
            f"secure aggregation: a group of {len(keys)} sites refused (this site masks only in "
            f"a group of at least {min_group}: node config secure-min-sites)"
        )
    if t < minimum_threshold(len(keys)) or t > len(keys):
        raise ClinfedError(
            f"secure aggregation: threshold {t} for {len(keys)} sites refused "
            f"(this site needs at least {minimum_threshold(len(keys))})"
        )
    self_seed = os.urandom(32)
    mask_private = _unb64(secrets["private"]["mask"])
    seed_shares = create_shares(self_seed, t, len(keys))
    key_shares = create_shares(mask_private, t, len(keys))
    order = sorted(keys)
    encrypt_key = bytes_to_private_key(_unb64(secrets["private"]["encrypt"]))
    outgoing, own = {}, None
    for position, other in enumerate(order):
        plaintext = share_keys_plaintext_concat(
            index, other, seed_shares[position], key_shares[position]
        )
        if other == index:
            own = _b64(plaintext)
            continue
        public = bytes_to_public_key(_unb64(keys[other]["encrypt"]))
        shared = generate_shared_key(encrypt_key, public)
        outgoing[str(other)] = _b64(encrypt(shared, plaintext))
    secrets |= {
        "stage": "share",
        "index": index,
        "threshold": t,
        # The site's own minimum group, held at every later stage too: a
        # server that drops members after the shares must not shrink the
        # group whose sum it learns below it.
        "min_group": min_group,
        "keys": {str(k): v for k, v in keys.items()},
        "self_seed": _b64(self_seed),
        "held": {str(index): own},
    }
    _save(_paths(state_dir, round_number)[0], secrets)
    return {"shares": outgoing}


def _mask(
    state_dir: Path, round_number: int, request: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Stage 3: the shares the others sent this site kept, and its upload
    sent masked (fixed point, its self mask and one pairwise mask per
    member of the group)."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    from clinfed.federated.state import load_tensors

    secrets = _load(state_dir, round_number, "share")
    index, t = secrets["index"], secrets["threshold"]
    keys = {int(k): v for k, v in secrets["keys"].items()}
    members = sorted({int(m) for m in request["members"]})
    if index not in members or not set(members) <= set(keys):
        raise ClinfedError("secure aggregation: the group is not the one shares were made for")
    least = max(t, int(secrets.get("min_group", 2)))
    if len(members) < least:
        raise ClinfedError(
            f"secure aggregation: {len(members)} sites left, below the threshold or this "
            f"site's minimum group ({least}): this site does not send"
        )
    incoming = dict(request["shares"])
    if set(incoming) != {str(m) for m in members if m != index}:
        raise ClinfedError("secure aggregation: shares missing from some of the group")
    held = dict(secrets["held"]) | _opened_shares(secrets, keys, index, incoming)
    names = list(request["names"])
    if not set(secrets["names"]) <= set(names):
        raise ClinfedError("secure aggregation: the round's names leave out this site's upload")
    upload = load_tensors(_paths(state_dir, round_number)[1])
    vectors, shapes = _fixed_point_vectors(secrets, upload, names, request["shapes"], members)
    mask_private = bytes_to_private_key(_unb64(secrets["private"]["mask"]))
    add_mask(vectors, _unb64(secrets["self_seed"]), +1)
    for other in members:
        if other == index:
            continue
        key = _mask_key(
            generate_shared_key(mask_private, bytes_to_public_key(_unb64(keys[other]["mask"])))
        )
        add_mask(vectors, key, +1 if index < other else -1)
    out = {
        name: torch.from_numpy(vector.view(np.int64).reshape(shapes[name]))
        for name, vector in zip(names, vectors)
    }
    out[WEIGHTS] = torch.from_numpy(vectors[-1].view(np.int64))
    secrets |= {"stage": "mask", "members": members, "held": held}
    _save(_paths(state_dir, round_number)[0], secrets)
    _paths(state_dir, round_number)[1].unlink(missing_ok=True)  # the plain upload
    return out, {}


def _opened_shares(
    secrets: Mapping[str, Any], keys: Mapping[int, Any], index: int, incoming: Mapping[str, str]
) -> dict[str, str]:
    """The shares other members sent this site, decrypted and checked to be
    from their sender and for this site."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        decrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    encrypt_key = bytes_to_private_key(_unb64(secrets["private"]["encrypt"]))
    opened = {}
    for source, ciphertext in incoming.items():
        shared = generate_shared_key(
            encrypt_key, bytes_to_public_key(_unb64(keys[int(source)]["encrypt"]))
        )
        try:
            plaintext = decrypt(shared, _unb64(ciphertext))
        except Exception:  # cryptography's InvalidToken: tampered or misaddressed
            raise ClinfedError(
                f"secure aggregation: the share from site {source} does not decrypt"
            ) from None
        src, dst, _, _ = share_keys_plaintext_separate(plaintext)
        if src != int(source) or dst != index:
            raise ClinfedError(f"secure aggregation: the share from site {source} is misaddressed")
        opened[source] = _b64(plaintext)
    return opened


def _fixed_point_vectors(
    secrets: Mapping[str, Any],
    upload: Mapping[str, torch.Tensor],
    names: list[str],
    shapes: Mapping[str, Any],
    members: list[int],
) -> tuple[list[np.ndarray], dict[str, tuple[int, ...]]]:
    """The site's weighted upload in fixed point, one vector per name of the
    round (zeros for a name only others send), then the weights vector."""
    own_names = set(secrets["names"])
    weight = int(secrets["weight"])
    bound = (1 << 63) / (SCALE * max(weight, 1) * len(members))
    vectors, tensors = [], {}
    for name in names:
        if name in own_names:
            value = upload[name]
            if float(value.abs().max()) >= bound:
                raise ClinfedError(
                    f"secure aggregation: {name} holds values beyond the fixed-point range "
                    f"(|x| < {bound:.3g})"
                )
            vector = fixed_point(value, weight)
            shape = tuple(value.shape)
        else:  # sent by others only: zeros, weight 0
            shape = tuple(int(s) for s in shapes[name])
            vector = np.zeros(math.prod(shape), np.uint64)
        vectors.append(vector)
        tensors[name] = shape
    weights = np.array([weight if n in own_names else 0 for n in names], np.int64)
    vectors.append(weights.view(np.uint64))
    return vectors, tensors


def _unmask(state_dir: Path, round_number: int, request: Mapping[str, Any]) -> dict[str, Any]:
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    secrets = _load(state_dir, round_number, "mask")
    index, t = secrets["index"], secrets["threshold"]
    survivors = {int(s) for s in request["survivors"]}
    dropped = {int(d) for d in request["dropped"]}
    members = set(secrets["members"])
    if survivors & dropped or not (survivors | dropped) == members or index not in survivors:
        raise ClinfedError(
            "secure aggregation: survivors and dropouts do not split this round's group"
        )
    least = max(t, int(secrets.get("min_group", 2)))
    if len(survivors) < least:
        raise ClinfedError(
            f"secure aggregation: {len(survivors)} survivors, below the threshold or this "
            f"site's minimum group ({least}): this site does not unmask"
        )
    answer = {}
    for source in sorted(members):
        _, _, seed_share, key_share = share_keys_plaintext_separate(
            _unb64(secrets["held"][str(source)])
        )
        answer[str(source)] = _b64(seed_share if source in survivors else key_share)
    forget(state_dir)  # answered once: nothing is left to ask
    return {"shares": answer}

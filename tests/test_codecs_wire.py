"""The wire format of the KV media, pinned: meta and buffers of a fixed small KV, byte for byte.

A refactoring of the codecs must not change what goes on the wire (receivers of another version
decode it, and the cache tier's stored records outlive processes). Each case encodes a fixed,
deterministic cache and compares the msgpack of its metadata and every buffer with the digests
recorded from the code before the layer-wise codec base existed; it then checks that the
pinned payload still decodes to what the codec decodes today.

The values are small integers scaled by powers of two (exact in every float dtype), so no case
depends on a random generator. The `lowrank` case uses a cache whose feature columns are
orthogonal (one non-zero per token row): its principal basis is a set of unit vectors, exact on
any LAPACK, so its digests do not depend on how a BLAS rounds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
import torch

from kvbus.codecs import Encoded, get_codec
from kvbus.kvcache import KVCache
from kvbus.signature import ModelSignature, dtype_name


def _signature(dtype: torch.dtype, *, layers: int = 2, heads: int = 2, head_dim: int = 8) -> ModelSignature:
    return ModelSignature(
        model="wire-pin", n_layers=layers, n_kv_heads=heads, head_dim=head_dim, dtype=dtype_name(dtype), vocab_size=1000
    )


def dense_kv(
    dtype: torch.dtype,
    *,
    seq: int = 12,
    batch: int = 1,
    extra_tokens: int = 0,
    positions: bool = False,
    fidelity: float = 1.0,
) -> KVCache:
    """A fixed cache: ``((i * 37 + 11) % 61 - 30) / 8`` over the flat index, per layer shifted."""
    sig = _signature(dtype)
    shape = (batch, sig.n_kv_heads, seq, sig.head_dim)
    n = batch * sig.n_kv_heads * seq * sig.head_dim

    def tensor(salt: int) -> torch.Tensor:
        i = torch.arange(n, dtype=torch.int64) + salt * 101
        x = ((i * 37 + 11) % 61 - 30).to(torch.float32) / 8
        x = x.view(shape).clone()
        x[..., 0] *= 16  # an outlier channel, as real keys have
        return x.to(dtype)

    keys = [tensor(2 * layer) for layer in range(sig.n_layers)]
    values = [tensor(2 * layer + 1) for layer in range(sig.n_layers)]
    tokens = (torch.arange(batch * (seq + extra_tokens), dtype=torch.int64) * 7 % 1000).view(batch, -1)
    pos = torch.arange(seq, dtype=torch.int64) * 2 + 1 if positions else None
    return KVCache(tokens=tokens, signature=sig, keys=keys, values=values, positions=pos, fidelity=fidelity)


def orthogonal_kv(dtype: torch.dtype) -> KVCache:
    """A cache whose token rows (``heads x head_dim`` features) each have one non-zero entry."""
    sig = _signature(dtype, head_dim=4)
    seq, features = 10, sig.n_kv_heads * sig.head_dim

    def tensor(salt: int) -> torch.Tensor:
        rows = torch.zeros(seq, features)
        for t in range(seq):
            col = (t * 3 + salt) % features
            rows[t, col] = float((col + 1) * (1 + salt % 2))
        return rows.view(1, seq, sig.n_kv_heads, sig.head_dim).permute(0, 2, 1, 3).contiguous().to(dtype)

    keys = [tensor(2 * layer) for layer in range(sig.n_layers)]
    values = [tensor(2 * layer + 1) for layer in range(sig.n_layers)]
    tokens = torch.arange(seq, dtype=torch.int64).view(1, -1) + 5
    return KVCache(tokens=tokens, signature=sig, keys=keys, values=values)


def token_only_kv() -> KVCache:
    sig = _signature(torch.float16)
    return KVCache(tokens=torch.arange(6, dtype=torch.int64).view(1, -1) * 3, signature=sig, keys=[], values=[])


#: case name -> (spec, a function making the cache).
CASES: dict[str, tuple[str, Any]] = {
    "full-f32": ("full", lambda: dense_kv(torch.float32)),
    "full-bf16-batch2-positions": (
        "full",
        lambda: dense_kv(torch.bfloat16, batch=2, positions=True, extra_tokens=3, fidelity=0.75),
    ),
    "full-token-only": ("full", token_only_kv),
    "int8-f32": ("int8", lambda: dense_kv(torch.float32)),
    "int8-f16-batch2": ("int8", lambda: dense_kv(torch.float16, batch=2, extra_tokens=2)),
    "int8-bf16-positions": ("int8", lambda: dense_kv(torch.bfloat16, positions=True, fidelity=0.75)),
    "int8-empty-seq": ("int8", lambda: dense_kv(torch.float16, seq=0, extra_tokens=3)),
    "int4-f32": ("int4", lambda: dense_kv(torch.float32)),
    "int4-g4-f16-batch2": ("int4(4)", lambda: dense_kv(torch.float16, batch=2)),
    "int4-g5-bf16-ragged": ("int4(5)", lambda: dense_kv(torch.bfloat16, seq=7, positions=True)),
    "int4-empty-seq": ("int4", lambda: dense_kv(torch.float32, seq=0, extra_tokens=1)),
    "lowrank-r3-f32": ("lowrank(3)", lambda: orthogonal_kv(torch.float32)),
    "lowrank-r2-bf16": ("lowrank(2)", lambda: orthogonal_kv(torch.bfloat16)),
    "lowrank-full-rank-f16": ("lowrank(64)", lambda: orthogonal_kv(torch.float16)),
    "topk-int8": ("topk(0.5)+int8", lambda: dense_kv(torch.float32, seq=16)),
    "topk-int4": ("topk(keep=0.5,sink=2,window=4)+int4(4)", lambda: dense_kv(torch.float16, seq=16)),
    "delta-int8-no-base": ("delta+int8", lambda: dense_kv(torch.float32)),
}

#: case name -> (sha256 of msgpack(meta), [(size, sha256) of each buffer]), recorded before the refactoring
#: (the int8 cases, and the delta and topk ones over int8, again for int8's layout 2: its keys
#: centred per channel, with their offsets; a deliberate change of the wire, see codecs/int8.py).
PINNED: dict[str, tuple[str, list[tuple[int, str]]]] = {
    "delta-int8-no-base": (
        "9754217f7e1224c7df28b0b50d4b1d6999d576b8fad7d0e00f6c876598892fa2",
        [
            (96, "baa4c5f8907c940c5171d6bbd60c9b5fbe9c97ac9c9b9385964909ad1ce37c68"),
            (64, "b35dab5cb1af18b714b5c6e3793ddfe854d66d4b1629b998d2fc74a63369269f"),
            (64, "012b1f930bc014fa332486ef67beb34fbafcd6132f2c1e6f45ed6f04979deb20"),
            (96, "3203f92be75653c8ba35a79bee3613fea14707eed4ab81565c98fcc2cf9e6cb9"),
            (64, "9aea38f01e95fca8b8007800531af075aff98c46bb315f5b54dc4b89790d1980"),
            (64, "7109ec3393f3f308cd3584cb26ef76832f118c2c894366dcd4775167e48043ba"),
            (96, "571fc89f9871809f5b8773ed54e6a92578c70b58b6904c429ff5d51e377e035e"),
            (192, "d26227e171b2578482bfa8c884c62bd53fc5cef3c15d79c1a51bd4aa183a1e37"),
            (192, "e4997e8b6de2c6693afd7edbf6169dc36762f4e51f9c973dd1629fa5f96ab0f2"),
            (192, "9daa5f28e2ada92e637f4888fc47ed1508ae8fa4d0d01fba0c506f66cf2704c5"),
            (192, "374751300bcddd8d7062f179ed4c411e4d917ce67160742ed87968324e611934"),
        ],
    ),
    "full-bf16-batch2-positions": (
        "42795a2b29c625f4a4421d5b4ccb7fd1545992b8a81104f37dad25478ab444f0",
        [
            (240, "00ad1f8826ba2751102ad94b61ec766c3595d14969f48c7cf0cf386c4382970f"),
            (96, "c2cc52df89f63ff27013592d84c93ce6d42556b00e85131949e040755466a4fa"),
            (768, "a4a3db57c70132e868142084dafe31f8638da08b893f6079f98ce1127776d5a5"),
            (768, "712382a423fc2e25a54a4d3e8c8a25f1834001f0b12de48af438c652ee55adfd"),
            (768, "6a8651bd8118c4e8236856dd64d11b0552d10c2cced2925a25a3b5343c81bf0a"),
            (768, "1065be71428eb7fac4dae204071293d22ecafec41b4c8addc1277d3afa77078a"),
        ],
    ),
    "full-f32": (
        "8ce6a9a601119f2891176d5c33ce6fc156eadd267308417900c59f3e20e9be56",
        [
            (96, "baa4c5f8907c940c5171d6bbd60c9b5fbe9c97ac9c9b9385964909ad1ce37c68"),
            (768, "cdc709709d2d5c651f7b5d3684aeae65a8674156812e89dde11ba0e712674b7d"),
            (768, "6a71c59b9374b49a1164dcbbab14e08644469ec313f25997fc3c721e48b27f5c"),
            (768, "0d7b8c9ae81222855ad70ba00661fb17d69c7af67b47a6c1551798d0baf1eebe"),
            (768, "4a948a4bc3b800e9dadbef280000225f384a9692d4381dffbbfc381aaa187fed"),
        ],
    ),
    "full-token-only": (
        "03131ef79e48ee7931b979b73b0f558a02a94166eb97ee2bd089b87661a6e190",
        [
            (48, "a936f3d054e4b832a52a9c533b66abf84adf21c80fe04544e3f240c344346639"),
        ],
    ),
    "int4-empty-seq": (
        "47961bc9cc5978a82c0c98bffe2239a8b68024c143968d81cb416861a7758ae4",
        [
            (8, "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        ],
    ),
    "int4-f32": (
        "8ce6a9a601119f2891176d5c33ce6fc156eadd267308417900c59f3e20e9be56",
        [
            (96, "baa4c5f8907c940c5171d6bbd60c9b5fbe9c97ac9c9b9385964909ad1ce37c68"),
            (64, "1dc7697a66165e4aa6a958b78ad029d0cfb8b77a3887896350661fd9c47810e3"),
            (64, "42f07ae28bdf8a24d6b7f6ace187a50a9e784d21313a6055d2dd10df2869e4a9"),
            (96, "89191f69fe427d24ec683f472136e57fdf1200aa413e57c7f0ae5c90de0d66c1"),
            (96, "88b7a4bf0be045576bcffbff6b86ccdfc549a49ed6db1899e945afe96cb7085a"),
            (64, "794d4b628be3de1baddc2bd901977d8f2a6aecef10498523356ea9a9ca0a79ab"),
            (64, "a9ce362f705ff704cb165f0bb3908bf508c600ad2827c2e54f359c2cf4718620"),
            (96, "6b05ccafb7fb8c93f1788296d1e178b47036ff53358f3975af212ad83f656947"),
            (96, "456fd9db6f23d681cf082d260d0463c7a115292f1901a78bd049f836454558b9"),
            (96, "8ef9278c3b23722a2a95fc87a8e8a60902dbcd9ccf82e04b4ddec7f9486d4f4d"),
            (96, "a657961a8d45fd09f4e65d3c6768b0b64712c6bbf58c3a355e99c3f940ecb046"),
            (96, "8cd5222d087ef65d0bc5268ca1f28b49d7aaf3e5ccde4d08969de49173b59d90"),
            (96, "46ada399f521f34887fb5abf0bfbc15b5fda16967e3abb31ff8bedfb9b623f19"),
        ],
    ),
    "int4-g4-f16-batch2": (
        "b8710c2924064c5adbb9e561275b58c2c5bb793511dbe5dcf5522c3c94b0d3b0",
        [
            (192, "8a48f90a7cb6dc54e7bfd8f67141ff501b8d81075673e4f880c75546c099cec1"),
            (192, "a2c7d81a38caf19a3b2d9a9f6ca7128bb658efbf5108ab93a7857f552e6a9e0a"),
            (192, "93e031ad448773247d0dd722562649f723560330be84cee8378c0cd0db36d7ab"),
            (192, "1b54109c5919837ac9953164bce04e037a4d0089f15594d0c8911ad0f8e3ada4"),
            (192, "d339f9a302d6a4a65fb2f9228fea1da5cd12181406ba8bae414b6192b07d3e59"),
            (192, "0e9b4986ff535726fb50518dec1d7de193da52a379bf4db5187f8f4fbb01bfe0"),
            (192, "c06ccaf5c33c094b09fa6770aadef456ede591dea3facc3263703cd7e8a23ce2"),
            (192, "d26db35c7391147c91ea6a9ce87ad6add53dd020c0c3f96489c5d41a397713e0"),
            (192, "555273407b728c73882ec27aed1fd94e2b0460b15e4cae72eff0033f0d59663a"),
            (192, "c1f44e6b9d24336c2be928bf36ac2348cc8992340df54136e933f4f5f8264d43"),
            (192, "589686e5d3da5dbec91b1a0a4f7a15cd13523988f3332d99ccf000b168edbf43"),
            (192, "113260033ee8806595bd1c730d85ced6497b9156925e31fa7e55146ea93177f8"),
            (192, "47b4ae55cb6292bf24002b33e6de656c718544c6c20bf9002e53d2af64ab7da6"),
        ],
    ),
    "int4-g5-bf16-ragged": (
        "2e56cfeb485ad9eb7bda17474bb715622b12bf12367f71dc887158a6e5fe364d",
        [
            (56, "cc477f12dd934771ed1cf631800a81d8d454195bd7ff9196700b377e4f576f7b"),
            (56, "11ab13f0852aa019988ba3287d0eb7980a9fbb2c26d52183f55937bb1d9db06c"),
            (64, "b01a708c7bc9d91c5b3251289b5a73b8eee49eb92634d19938b378681976b69e"),
            (64, "fcedb582ba53cfe9f1b2370468db7e6bcddd039b781bd6bc5d30d30495403f50"),
            (28, "19e03356024346b9bc5cb451bb101e6b1f01c1300c20d09275059cc0848fde5d"),
            (28, "0d2a9b26b6ff85767f098a79553a5dc52de2f7e9631f5bde70c2ad0d01018e31"),
            (64, "0c1ac145a9913956ae615841542bdbcc7b423dc114f61dec7f207560b19f67d7"),
            (64, "e2753429b01233449bad82be819edf441366df0ffc01db166dc31b5aab17fd0d"),
            (28, "b0a933efc44f03a5dc07a885d8a28a521a663c33d936f3ef1cbe5d50a3b0700d"),
            (28, "1cae95cc43eb9857d594c18ce2cbd33ba07f7e310e773f9b1dca8d05fd3759c4"),
            (80, "07c00921f6cb8b00dfebf38b53900c5c1ae876510ef2cae58541a59a2052a550"),
            (56, "0387d7694e58b1874d62b6dd271669a07a18d19046f4199874d525e3770289fb"),
            (80, "a635e35d875189ec011a5a6e13b6b0ddfba4e6e0e86dfc91136a4110704c311d"),
            (56, "e2006cd81750c22844cbdf89bcee098b1dc1f2dc4102f80ce33bd6290ec373c7"),
        ],
    ),
    "int8-bf16-positions": (
        "3fe1447eaf39f974c2b08464227f73104a2c3db2bcba8f3bfd6454ad1d2c4ea8",
        [
            (96, "baa4c5f8907c940c5171d6bbd60c9b5fbe9c97ac9c9b9385964909ad1ce37c68"),
            (96, "c2cc52df89f63ff27013592d84c93ce6d42556b00e85131949e040755466a4fa"),
            (32, "044da81ab307a03f4e6b26096aae842e0fc9c8224f0d3c16f6215e1a6e64e7a5"),
            (32, "b46ff19f6ae1127d92f8235c35a47d00e0ac68d0e209d66af67c0f863bbfd047"),
            (48, "68706559fd6c9b93647e6433f8bd7e68a19a710fbd110333d9b1369dfe39edcb"),
            (32, "261c0ffa6e203a738db3cadfb786a0f385cd9ce7f99671133b183f6e2eb58fe0"),
            (32, "f7ad8c8c3530da534835dac0d22c479a195df400f036780716b7da5a8a5cfd7e"),
            (48, "5c789cd3191c915fcbab1b1c7b31c676b73580a30677e3d213927a75ee1a18d3"),
            (192, "3130147800e7ccd47d59d1b7230dc43925fea6a27b30514e9b6172516b53f6a8"),
            (192, "9af58f06f0c070854dd4519ea30889c160dfe249dcdb10da999138e26d965f1b"),
            (192, "3ac58d68f0350ec9147590d01d602afbfd9345247e186247c3a211e7c9b82c0f"),
            (192, "92ac8249e4ad2a34b5b2669b0741cc441d1ff71303a8092df878bb72f6f7de40"),
        ],
    ),
    "int8-empty-seq": (
        "ee05cc40a06c6792d95e35fa4bc0af4fbdac6ee897f98ff8620facecad4dd7b1",
        [
            (24, "a13015e20566ed01eba44bc6ed1d20cac2b386a8737763d42324014e9cf44c8e"),
            (32, "9c8083a0aa45a18c23e1bcf0f2bd4816d5b1512ac08569772df28f06954a9c4d"),
            (32, "66687aadf862bd776c8fc18b8e9f8e20089714856ee233b3902a591d0d5f2925"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (32, "9c8083a0aa45a18c23e1bcf0f2bd4816d5b1512ac08569772df28f06954a9c4d"),
            (32, "66687aadf862bd776c8fc18b8e9f8e20089714856ee233b3902a591d0d5f2925"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        ],
    ),
    "int8-f16-batch2": (
        "8a0d917d7b9f013174a46785a86120def1b95081aa40839aa08d8615c070cd2e",
        [
            (224, "2113c32ace7e2b10186925a6f75b3d364067d74208b74fd7bf3ab70aec29d873"),
            (64, "b313d4bb9bfe0cd4cb006261eff863b087cab4bd3b4a8e2a8c818318d7bf3015"),
            (64, "e16e73ebf9b9cdd777f31a2127eb696aebe9f5607f5ff2f817d693db9a32d890"),
            (96, "01400832bd5e556a323120706e34f0621ce89f214efebdc27ef1768561f28216"),
            (64, "76f93144ec9dd0b8043de4c5e721d2819cf13dbcedf878a24f2de8a00631d8a4"),
            (64, "711ff922c384a107c3cd10ef73e62dbd5659e1ce6176a3ffb26f3f99bb7b0d7c"),
            (96, "aa78c997e3fd677bcfcce486edd054031d16ec66732475bb804e85f5a32f940d"),
            (384, "2586f8f51334348b371183b74f17b655595b6d78ccedc13bf6245a1ec6372fe9"),
            (384, "2fb0391d6c1b94d8541d62ca5b734d27dcf767867e2dd7853db8010cd57d6ae7"),
            (384, "406c42e880985e6a2661565849e6d5f639d87aca25cea3c26f50de806b64b6a4"),
            (384, "3c543f1b50debd0457f3430339dae9cd6162ad05902f83a1e6a7a51e38670df5"),
        ],
    ),
    "int8-f32": (
        "4620593d358161ddeeb2611da2881273c3f92752421409579b0b3f581e2ae3e7",
        [
            (96, "baa4c5f8907c940c5171d6bbd60c9b5fbe9c97ac9c9b9385964909ad1ce37c68"),
            (64, "b35dab5cb1af18b714b5c6e3793ddfe854d66d4b1629b998d2fc74a63369269f"),
            (64, "012b1f930bc014fa332486ef67beb34fbafcd6132f2c1e6f45ed6f04979deb20"),
            (96, "3203f92be75653c8ba35a79bee3613fea14707eed4ab81565c98fcc2cf9e6cb9"),
            (64, "9aea38f01e95fca8b8007800531af075aff98c46bb315f5b54dc4b89790d1980"),
            (64, "7109ec3393f3f308cd3584cb26ef76832f118c2c894366dcd4775167e48043ba"),
            (96, "571fc89f9871809f5b8773ed54e6a92578c70b58b6904c429ff5d51e377e035e"),
            (192, "d26227e171b2578482bfa8c884c62bd53fc5cef3c15d79c1a51bd4aa183a1e37"),
            (192, "e4997e8b6de2c6693afd7edbf6169dc36762f4e51f9c973dd1629fa5f96ab0f2"),
            (192, "9daa5f28e2ada92e637f4888fc47ed1508ae8fa4d0d01fba0c506f66cf2704c5"),
            (192, "374751300bcddd8d7062f179ed4c411e4d917ce67160742ed87968324e611934"),
        ],
    ),
    "lowrank-full-rank-f16": (
        "65c1fa77787df605763c7b02eaa17056b76bbf35a9b315a1d0c16ac3a6335c32",
        [
            (80, "8d3d4da9b5f95fa06802222d85116cb0e26b543afa0d4688a60e75d17b3cf044"),
            (160, "e00f361f390c59dbe1c87cc5449fb6bead58786998941ba2ee152a53192ed926"),
            (128, "433e1fede1be2eeaa1731291a5af99b20a0c40cb64ee2d9741e12010c00b55bf"),
            (160, "9ffd056b6d364dd685fa5a9ba0a8544177e707a87da4b5bd9be8cbc2cd76624c"),
            (128, "b362d46e4814918e382ac31248c962641485bad78149a2fdfe3e35b46b1b51cd"),
            (160, "7929f0e5ab6c1cb2af2e7057107a84232e3cb2336b53d8dc95ca56992834b7f5"),
            (128, "762e92c8a2c3a9e808262d6d489fc0b1f8021187aea24e8f215a44e6b743d7d6"),
            (160, "c257ba7ed3d28c5dcf8f1d4c3b9d20ae4a7483b99538602a42ec616c8ff8d96c"),
            (128, "ed8423e1493fe5546248a34295677d6ad0670cde728757405264fbc2e438d0e9"),
        ],
    ),
    "lowrank-r2-bf16": (
        "986b0cb01649be2bb89fc59f2d1c3c6479af43494a4d38fce0612d7ad1f00531",
        [
            (80, "8d3d4da9b5f95fa06802222d85116cb0e26b543afa0d4688a60e75d17b3cf044"),
            (40, "c5727193855396e4109d909ccaca6139bde991bf436cc7e525c631af79609536"),
            (32, "9862b929dc17107ace35305a7dcdebbbfeebec7ee659e559b1f4a84a26694134"),
            (40, "cd97a015f9217acd6a8d3a6f23af40cf92d217f8f0b13dd1146a6d10f11b5ad3"),
            (32, "c494e0d4d917d80d75c03301ee066d31ba358c38edab41c7b11afb89ea3ddc47"),
            (40, "5f872abc2777906fea453ef8903fd1fb520c51fe7d4b51cfc282627e612fb527"),
            (32, "0a619d4b3bd12644073d88b3264190c695c60dd31e07c472d7ee5ce6109797eb"),
            (40, "d3bedc60ac7f05210ad4a9955efc18ba46e03a52838a6a39cf6064f5a94d2454"),
            (32, "bab70cfe325ab6a0b192f021e3c489e455a4cd70121f8959847a44f713fa3f96"),
        ],
    ),
    "lowrank-r3-f32": (
        "0708cae1d6d276b3154b762b9b58507c708f37ccea4a60e65568775163eb4dc5",
        [
            (80, "8d3d4da9b5f95fa06802222d85116cb0e26b543afa0d4688a60e75d17b3cf044"),
            (120, "845b73b9b7bf9be466d28c66baf7ec37b932b560b386257667ebd16b2e864171"),
            (96, "926f7db56f6f3cf6b53bc6eb345154335612146e628f3d1d9781678c0e161255"),
            (120, "33e20847a3036044b5308a6c2d6c17795e919206ff2f427e1a3bb8dd986498c1"),
            (96, "54d128659e01579f7dac114f1766505894af3f83dacd468c0678f85d63141f5f"),
            (120, "4c7f18bca96540fe90d52d14fc368b2570b09f916f7a82406a36340a44723b52"),
            (96, "91bd5f84be264879da6e9b2181b3115f5fd6dd8015efe978360d3d623972f628"),
            (120, "6942518b276a060678021966e352625e677a1d57802a58c33a36aaef19a8036f"),
            (96, "03a2d4f3b586ac149f502e1f8a5fb4d3f2070ed778e3ea8f4c0aa663d29fd271"),
        ],
    ),
    "topk-int4": (
        "ba151f69e9fb960a10e660ca46b8823ea4d9c8029e2d4bd5b4694b1df404ad4c",
        [
            (128, "788a6a81f2af746254d2439a2abe3a549a14e2f149d6f08551dc0a14bdd97ca5"),
            (64, "5fe4848e4066da0bca46fe8b7d64012f18c351831454f33365b3c4b1eea38126"),
            (64, "2587ca6a232a49ef2ea452f61b7e71d2d5f97fa5e1d77c40b06db3d54693deea"),
            (64, "c6c467739f97d1dbadc43d73b77cf15fa8ffc8bff3e65f09ef7b35a648269d66"),
            (64, "dc1f76f2e7192a5a1a91f647c4a6c801b53dfa61be2c7cb7be74e660bb87cf8e"),
            (64, "220279d6a32ab3d69ed93976570b10dad3f478363bb9721a158e8acd26186de8"),
            (64, "639d8b6769e320acd02237998d92bc9fe19c92f9c9abc804245efc3790c36a3a"),
            (64, "a6b174364851c308dfdbcb7f6323264453b180806004020e47ad6ba2a673ebd6"),
            (64, "819144747b5a18ba0c64da2aa550767eda79905bcd23d707bc7fdbaf97d229c4"),
            (64, "d785bf5f40cb32ea01b3a3883ba914b4e2791d89f1b31b4ca98af1eee9a34008"),
            (64, "0c114264b16a317ec23ea7c993e96fb2d999be8da2b743bd1d4d5ff668c7d361"),
            (64, "6f5435350f635879e503da84e359b1ae0fddb3b3cba0eb1d7838d903add76c39"),
            (64, "8b6b27a39296e08313e22d36b38298d9e5a0eb5941e6963dbdfa6f040b2a9252"),
            (64, "26851e3e501740971f6dd5d772278adcecddeed666f7fc02cdfd653e3d42136e"),
        ],
    ),
    "topk-int8": (
        "4c065a9ec6aad9f34712cdca260c16d4cd184335fcd81d77d44086063fa91727",
        [
            (128, "788a6a81f2af746254d2439a2abe3a549a14e2f149d6f08551dc0a14bdd97ca5"),
            (64, "7bf45b3102b57d4a20e227824bee421658008f011bcb23a743d2934270d5388e"),
            (64, "ac7e7d875fbfdbb8f45c8a351e556bb93b16f77a23ce854cf97898e2887478b9"),
            (64, "4bfcc8dec1fc173858c1e054e134ae57381fcd99ee7f288eb2e387999a023235"),
            (64, "325fb39982b0d35981de2837c70030d55b5767d64b26e770324910ed8e5eeb59"),
            (64, "2f00acd6976da461d58b7913e8cffc487260fbb790703fd0de4069cd18b86780"),
            (64, "aec6529a941380ce170899739c0c4b980170b13f1e3219dd4558eefbfbba012a"),
            (64, "1df271e1a231640cbe911665e296f8ad59399a54e75b3c729b4f652ddf708940"),
            (128, "fc9e6955b75420d45ffce94225081edf9a58a5594c6e668d3b4d95b04ce430ba"),
            (128, "ad4dcfab7341a8c386d27a82292e2059dc513d2aaa1c30dd267195e6a8b3f0d8"),
            (128, "ff27e0369c0c41020504b85b9a5186e9189243f17125176327e92bc14ac84158"),
            (128, "2d32a5e88b231b9bd373cb691d9d2fb6954eabe022da6273810678042b1499de"),
        ],
    ),
}


def digests(encoded: Encoded) -> tuple[str, list[tuple[int, str]]]:
    meta = hashlib.sha256(msgpack.packb(encoded.meta, use_bin_type=True)).hexdigest()
    return meta, [(b.nbytes, hashlib.sha256(b).hexdigest()) for b in encoded.buffers]


def test_every_case_is_pinned() -> None:
    assert sorted(PINNED) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_encoded_meta_and_buffers_are_pinned(case: str) -> None:
    spec, make = CASES[case]
    codec = get_codec(spec)
    encoded = codec.encode(make())
    assert encoded.codec == codec.name
    meta, buffers = digests(encoded)
    want_meta, want_buffers = PINNED[case]
    assert [n for n, _ in buffers] == [n for n, _ in want_buffers], "buffer count or sizes changed"
    assert meta == want_meta, "metadata changed"
    for i, (got, want) in enumerate(zip(buffers, want_buffers)):
        assert got == want, f"buffer {i} changed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_pinned_payload_decodes_as_before(case: str) -> None:
    """Encoding twice is deterministic, and decoding what went over the wire gives the same cache."""
    spec, make = CASES[case]
    codec = get_codec(spec)
    kv = make()
    first, second = codec.encode(kv), codec.encode(kv)
    assert digests(first) == digests(second)
    payload = b"".join(first.buffers)
    meta = msgpack.unpackb(msgpack.packb(first.meta, use_bin_type=True), raw=False)
    out = codec.decode(Encoded.from_payload(first.codec, meta, payload, first.sizes))
    again = codec.decode(second)
    assert out.equal(again)
    assert out.fidelity == again.fidelity
    assert out.seq_len == kv.seq_len or spec.startswith("topk")

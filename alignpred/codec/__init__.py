"""The AlignPred codec: configuration, the error budget and its scopes' strategies, the coding
frame, predictors and their plans, rate control (step search), the encoder and the decoder (with
its stage timer), and the speed profiles."""
from alignpred.codec.budget import DEFAULT_EPS, JOINT, SCOPES, TENSOR_CAP, ErrorBudget, TensorMeta, named_kl
from alignpred.codec.config import CodecConfig
from alignpred.codec.decoder import Decoder, StageTimer
from alignpred.codec.encoder import EncodedObject, Encoder
from alignpred.codec.profiles import PROFILES, Profile, profile
from alignpred.codec.scopes import SCOPE_REGISTRY, Scope, scope_of

__all__ = ["DEFAULT_EPS", "JOINT", "SCOPES", "TENSOR_CAP", "ErrorBudget", "TensorMeta", "named_kl", "CodecConfig",
           "Decoder", "StageTimer", "EncodedObject", "Encoder", "PROFILES", "Profile", "profile", "Scope",
           "SCOPE_REGISTRY", "scope_of"]

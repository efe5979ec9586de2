"""A LeRobot policy plugin for JoyNexus exports.

Importing this package registers the ``joynexus`` policy type with LeRobot
(``PreTrainedConfig.register_subclass``); LeRobot's ``register_third_party_plugins()`` imports it
because the distribution is named ``lerobot_policy_*``. By LeRobot's naming convention
``make_policy`` then finds ``JoyNexusPolicy`` in ``modeling_joynexus`` and
``make_joynexus_pre_post_processors`` in ``processor_joynexus``.

An export directory (``joynexus.artifacts.exports.export_directory``) becomes a LeRobot policy
directory with ``write_lerobot_policy(export_dir, backbone, ...)``.
"""

from lerobot_policy_joynexus.configuration_joynexus import JoyNexusConfig
from lerobot_policy_joynexus.export import write_lerobot_policy
from lerobot_policy_joynexus.modeling_joynexus import JoyNexusPolicy
from lerobot_policy_joynexus.processor_joynexus import make_joynexus_pre_post_processors

__all__ = ["JoyNexusConfig", "JoyNexusPolicy", "make_joynexus_pre_post_processors", "write_lerobot_policy"]

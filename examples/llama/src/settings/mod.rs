//! The floor of typed, validated settings: what a run is asked to do, before anything runs.
//!
//! Every other module reads its settings from here and none of them writes a rule about them:
//! [`TrainSettings::check`] owns every rule over the training settings (single-field and
//! cross-field), and [`Curation::check`] the loop's. The command line, the demo and the study
//! build the same types and are refused by the same checks; a refusal names the settings'
//! fields ([`SettingError`]), and a front end names its own options for them.
//!
//! Serialised (serde), the settings are the records of what a run was made with: a resumed or
//! reused stage compares them field for field ([`crate::stage`]).

mod iterate;
mod train;

pub use iterate::{Curation, IterateSettings};
pub use train::{
    Advantage, Baseline, DpoLoss, KlEstimatorSetting, Objective, Proximal, SettingError, TrainSettings,
    default_dro_beta,
};

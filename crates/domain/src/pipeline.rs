//! The pipeline as data (design.md §3) and the pure function that decides a task's next stage from
//! a gate's outcome.
//!
//! No LLM is in the control loop: where a task goes after a stage depends only on the stage's
//! transitions, the gate's verdict and how many times the task already looped back. Loops back
//! to implementation carry the failing artifact as feedback and are bounded; past the bound the
//! task fails with the reason.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use crate::gate::{
    ArtifactPattern, ArtifactSpec, GateOutcome, Verdict, check_artifacts, merge_log_spec,
    post_deploy_log_spec, review_spec, staging_log_spec, test_report_spec,
};
use crate::ids::{AgentName, ArtifactName, StageName, WorkItemId};

/// The names of the runner's built-in executors, which a [`StageDef::executor`] names: the
/// runner registers each one under its name here, and the engine runs a stage with the
/// executor its descriptor names (never by the stage's or the agent's name).
pub mod executors {
    /// Every LLM stage: the agent backends (the stage's `agent` picks the configured one).
    pub const AGENT: &str = "agent";
    /// Writes `01-request.md` from the submitted request.
    pub const INTAKE: &str = "intake";
    /// Runs the repo's tests (`12-test-report.md`).
    pub const TESTER: &str = "tester";
    /// Builds and verifies the release candidate (`14-merge-log.md`).
    pub const MERGE_GATE: &str = "merge-gate";
    /// The staging runner of ORCH-115 (`15-staging-log.md`).
    pub const STAGING: &str = "staging";
    /// Promotes the staged commit, then deploys it (the deployer and its finalizer).
    pub const DEPLOY: &str = "deploy";
    /// The post-deploy watch, one poll per job (ORCH-021).
    pub const MONITOR: &str = "post-deploy-monitor";
    /// `17-lessons.md` and the repo's lessons file.
    pub const LESSONS: &str = "lessons";
}

/// The release train's record of a revert (`18-revert.md`), which the stages that may roll a
/// change back (deploy, observe) write beside their own documents.
pub const REVERT_LOG: &str = "18-revert.md";

/// The outcome value with which the deploy stage sends a task back to `merge` when the
/// default branch moved since its candidate was staged.
pub const RESTAGE: &str = "RESTAGE";

/// The outcome value with which the staging runner reports that the infrastructure stayed
/// broken through every defer (`15-staging-log.md` says `staging_status: FAILED`,
/// `failure_kind: tool_error_exhausted`): the item fails without looping back, since the
/// change was never shown to be at fault (`orch retry` stages it again once the environment
/// is back).
pub const TOOL_ERROR_EXHAUSTED: &str = "TOOL_ERROR_EXHAUSTED";

/// Outcome values an executor reports itself, beside its stage's status values.
const REPORTED: [&str; 2] = [RESTAGE, TOOL_ERROR_EXHAUSTED];

/// Default bound on loops back to an earlier stage, per work item.
pub const DEFAULT_MAX_LOOPS: u32 = 3;

/// Who does a stage's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageKind {
    /// An LLM agent backend writes the artifact.
    Llm,
    /// Deterministic code (tests, merge, staging runner, deploy, monitor, lessons).
    Deterministic,
}

/// Which gate outcome a transition applies to. Lookup order for a pass with value `v`:
/// `Value(v)`, then `Pass`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum On {
    /// The gate passed with exactly this status value.
    Value(String),
    /// The gate passed (any value without a `Value` entry of its own).
    Pass,
    /// The gate did not pass.
    NotSuccess,
}

impl fmt::Display for On {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            On::Value(v) => write!(f, "{v}"),
            On::Pass => f.write_str("pass"),
            On::NotSuccess => f.write_str("not success"),
        }
    }
}

/// Where a task goes after a gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// On to this stage.
    Next(StageName),
    /// Back to an earlier stage with the failing artifact as feedback; counts against the
    /// pipeline's loop bound.
    LoopBack {
        /// The stage to go back to (implementation, by default).
        to: StageName,
        /// The artifact the next attempt gets as feedback.
        feedback: ArtifactName,
    },
    /// The task fails.
    Fail,
    /// The task is done.
    Done,
}

/// One stage of the pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageDef {
    /// The stage's name.
    pub name: StageName,
    /// The job kind that handles the stage; `None` for `intake`, which happens on submit.
    pub agent: Option<AgentName>,
    /// Whether an LLM or deterministic code does the work.
    pub kind: StageKind,
    /// The artifacts the stage must leave.
    pub artifacts: Vec<ArtifactSpec>,
    /// Where the task goes for each gate outcome.
    pub transitions: BTreeMap<On, Transition>,
    /// Whether the task waits for `orch approve` before this stage runs.
    pub approval: bool,
    /// Whether the stage's jobs run on the node that enqueued them (deploy and observe: their
    /// markers and the watch's state live on that machine until it is gone, then a takeover
    /// moves them).
    pub pinned: bool,
    /// The executor that does the stage's work: a name the runner's table of executors knows
    /// ([`executors`] for the built-in ones).
    pub executor: String,
    /// Whether the stage may write code anywhere outside the protected places (the developer's
    /// `implementation`; its agent also runs the repo's commands).
    pub writes_code: bool,
    /// Whether the stage writes the repo's lessons file (`lessons`).
    pub writes_lessons: bool,
    /// Documents the stage may write in its item's folder besides its own artifacts (deploy and
    /// observe: the release train's [`REVERT_LOG`]); no other stage's gate reads them.
    pub also_writes: Vec<ArtifactName>,
    /// Whether the stage is on the repo's **release track**: at most one task of a repo is at
    /// any of these stages at a time (merge → staging → deploy → observe → lessons), so the
    /// candidate that staging verified is exactly what reaches the default branch and
    /// production.
    pub release_track: bool,
}

impl StageDef {
    /// A stage named `name`, run by `executor` (with `agent`'s job kind, if any), with no
    /// artifacts, no transitions and every policy flag off: set the fields that apply.
    pub fn new(
        name: StageName,
        agent: Option<AgentName>,
        kind: StageKind,
        executor: &str,
    ) -> StageDef {
        StageDef {
            name,
            agent,
            kind,
            artifacts: Vec::new(),
            transitions: BTreeMap::new(),
            approval: false,
            pinned: false,
            executor: executor.to_owned(),
            writes_code: false,
            writes_lessons: false,
            also_writes: Vec::new(),
            release_track: false,
        }
    }

    /// The stage run by executor `name`.
    pub fn run_by(mut self, name: &str) -> StageDef {
        self.executor = name.to_owned();
        self
    }

    /// The stage on the repo's release track ([`StageDef::release_track`]).
    pub fn on_release_track(mut self) -> StageDef {
        self.release_track = true;
        self
    }

    /// The stage's jobs pinned to the node that enqueued them ([`StageDef::pinned`]).
    pub fn keeping_local_state(mut self) -> StageDef {
        self.pinned = true;
        self
    }

    /// The stage may write code ([`StageDef::writes_code`]).
    pub fn writing_code(mut self) -> StageDef {
        self.writes_code = true;
        self
    }

    /// The stage writes the lessons file ([`StageDef::writes_lessons`]).
    pub fn writing_lessons(mut self) -> StageDef {
        self.writes_lessons = true;
        self
    }

    /// The stage may also write document `name` ([`StageDef::also_writes`]).
    pub fn also_writing(mut self, name: ArtifactName) -> StageDef {
        self.also_writes.push(name);
        self
    }

    /// The job kind of the stage's jobs: its agent's name, else the stage's own (`intake`).
    pub fn job_kind(&self) -> &str {
        self.agent
            .as_ref()
            .map_or(self.name.as_str(), |a| a.as_str())
    }

    /// Runs the stage's gate over the files in the work item's folder (name and content of each).
    pub fn check(&self, work_item: &WorkItemId, files: &[(ArtifactName, &str)]) -> GateOutcome {
        check_artifacts(&self.artifacts, work_item, files)
    }

    /// The allowed values of the stage's status key, if it has one.
    fn status_values(&self) -> Option<&[String]> {
        self.artifacts
            .iter()
            .find_map(|a| a.status_key.as_ref())
            .map(|s| s.allowed.as_slice())
    }
}

/// The stages a work item goes through, in order, and the loop bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    /// The stages in order; the first is where a submitted work item starts.
    pub stages: Vec<StageDef>,
    /// How many loops back a work item may take before it fails.
    pub max_loops: u32,
}

/// What to do with a task after its stage's gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The stage to move to (possibly terminal: `done` or `failed`).
    pub next_stage: StageName,
    /// Whether this is a loop back (the caller counts these).
    pub loop_back: bool,
    /// The artifact to hand to the next attempt as feedback, on a loop back.
    pub feedback: Option<ArtifactName>,
    /// Whether the next stage waits for approval before it runs.
    pub needs_approval: bool,
    /// Why, for the event log.
    pub reason: String,
}

/// A pipeline that cannot be used, or a question it cannot answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    /// The pipeline has no stages.
    #[error("the pipeline has no stages")]
    Empty,
    /// Two stages share a name.
    #[error("stage `{0}` is defined twice")]
    DuplicateStage(StageName),
    /// A stage uses the name of a terminal stage.
    #[error("stage `{0}` uses the name of a terminal stage (done, failed, cancelled)")]
    TerminalName(StageName),
    /// A stage or transition names a stage that does not exist.
    #[error("stage `{from}`: on {on}, the transition goes to unknown stage `{to}`")]
    UnknownTarget {
        /// The stage whose transition is wrong.
        from: StageName,
        /// The outcome the transition is for.
        on: On,
        /// The unknown stage.
        to: StageName,
    },
    /// An LLM stage has no agent.
    #[error("stage `{0}` is an LLM stage but names no agent")]
    MissingAgent(StageName),
    /// A stage names no executor.
    #[error("stage `{0}` names no executor")]
    MissingExecutor(StageName),
    /// A stage has more than one artifact with a status key.
    #[error("stage `{0}` has more than one artifact with a status key")]
    SeveralStatusKeys(StageName),
    /// A transition is keyed on a status value the stage's artifact cannot have.
    #[error("stage `{stage}`: transition on `{value}`, which is not an allowed status value")]
    UnknownValue {
        /// The stage.
        stage: StageName,
        /// The value no artifact allows.
        value: String,
    },
    /// Some gate outcome of a stage has no transition.
    #[error("stage `{stage}` has no transition for outcome {on}")]
    MissingTransition {
        /// The stage.
        stage: StageName,
        /// The outcome without a transition.
        on: On,
    },
    /// A loop back's feedback is not one of the stages' artifacts.
    #[error("stage `{stage}`: loop-back feedback `{feedback}` is not an artifact of any stage")]
    UnknownFeedback {
        /// The stage.
        stage: StageName,
        /// The feedback artifact.
        feedback: ArtifactName,
    },
    /// `done` cannot be reached from a stage.
    #[error("stage `{0}` has no path to `done`")]
    NoPathToDone(StageName),
    /// The stage is not in the pipeline.
    #[error("stage `{0}` is not in the pipeline")]
    UnknownStage(StageName),
    /// The stage is terminal: nothing comes after it.
    #[error("stage `{0}` is terminal; nothing comes after it")]
    Terminal(StageName),
}

fn v_is(on: &On, value: &str) -> bool {
    matches!(on, On::Value(v) if v == value)
}

impl Default for Pipeline {
    fn default() -> Pipeline {
        Pipeline::default_pipeline()
    }
}

fn stage(name: &'static str) -> StageName {
    StageName::known(name)
}

fn artifact(name: &'static str) -> ArtifactName {
    ArtifactName::known(name)
}

fn spec(name: &'static str) -> ArtifactSpec {
    ArtifactSpec::new(artifact(name))
}

fn next(name: &'static str) -> Transition {
    Transition::Next(stage(name))
}

fn back_to_implementation(feedback: &'static str) -> Transition {
    Transition::LoopBack {
        to: stage("implementation"),
        feedback: artifact(feedback),
    }
}

fn value(v: &str) -> On {
    On::Value(v.to_owned())
}

impl Pipeline {
    /// The built-in pipeline of design.md §3.
    pub fn default_pipeline() -> Pipeline {
        use StageKind::{Deterministic, Llm};
        let def = |name: &'static str,
                   agent: Option<&'static str>,
                   kind: StageKind,
                   artifacts: Vec<ArtifactSpec>,
                   transitions: Vec<(On, Transition)>| {
            // A runner's stage names its executor below ([`StageDef::run_by`]).
            let executor = match kind {
                Llm => executors::AGENT,
                Deterministic => "",
            };
            StageDef {
                artifacts,
                transitions: transitions.into_iter().collect(),
                ..StageDef::new(stage(name), agent.map(AgentName::known), kind, executor)
            }
        };
        let stages = vec![
            def(
                "intake",
                None,
                Deterministic,
                vec![spec("01-request.md")],
                vec![
                    (On::Pass, next("analysis")),
                    (On::NotSuccess, Transition::Fail),
                ],
            )
            .run_by(executors::INTAKE),
            def(
                "analysis",
                Some("analyst"),
                Llm,
                vec![spec("02-requirements.md")],
                vec![
                    (On::Pass, next("architecture")),
                    (On::NotSuccess, Transition::Fail),
                ],
            ),
            def(
                "architecture",
                Some("architect"),
                Llm,
                vec![
                    spec("06-architecture.md"),
                    ArtifactSpec::family("07-adr-"),
                    spec("08-data-requirements.md"),
                ],
                vec![
                    (On::Pass, next("implementation")),
                    (On::NotSuccess, Transition::Fail),
                ],
            ),
            def(
                "implementation",
                Some("developer"),
                Llm,
                vec![spec("10-implementation.md")],
                vec![
                    (On::Pass, next("review")),
                    (On::NotSuccess, Transition::Fail),
                ],
            )
            .writing_code(),
            def(
                "review",
                Some("reviewer"),
                Llm,
                vec![review_spec()],
                vec![
                    (value("APPROVED"), next("verification")),
                    (
                        value("CHANGES_REQUESTED"),
                        back_to_implementation("11-review.md"),
                    ),
                    (On::NotSuccess, back_to_implementation("11-review.md")),
                ],
            ),
            def(
                "verification",
                Some("tester"),
                Deterministic,
                vec![test_report_spec()],
                vec![
                    (value("PASSED"), next("merge")),
                    (value("FAILED"), back_to_implementation("12-test-report.md")),
                    (On::NotSuccess, back_to_implementation("12-test-report.md")),
                ],
            )
            .run_by(executors::TESTER),
            def(
                "merge",
                Some("merge-gate"),
                Deterministic,
                vec![merge_log_spec()],
                vec![
                    (value("MERGED"), next("staging")),
                    (value("CONFLICT"), back_to_implementation("14-merge-log.md")),
                    (value("FAILED"), Transition::Fail),
                    (On::NotSuccess, Transition::Fail),
                ],
            )
            .run_by(executors::MERGE_GATE)
            .on_release_track(),
            def(
                "staging",
                Some("deployer"),
                Deterministic,
                vec![staging_log_spec()],
                vec![
                    (value("SUCCESS"), next("deploy")),
                    (value("FAILED"), back_to_implementation("15-staging-log.md")),
                    (value(TOOL_ERROR_EXHAUSTED), Transition::Fail),
                    (On::NotSuccess, back_to_implementation("15-staging-log.md")),
                ],
            )
            .run_by(executors::STAGING)
            .on_release_track(),
            // The deployer and its finalizer report the outcome directly (events, no artifact).
            def(
                "deploy",
                Some("deployer"),
                Deterministic,
                vec![],
                vec![
                    (On::Pass, next("observe")),
                    // The default branch moved after staging (a push from outside orch): the
                    // candidate is rebuilt and staged again (not a loop back: nothing failed).
                    (value(RESTAGE), next("merge")),
                    (On::NotSuccess, Transition::Fail),
                ],
            )
            .run_by(executors::DEPLOY)
            .on_release_track()
            .keeping_local_state()
            .also_writing(artifact(REVERT_LOG)),
            // The post-deploy log is written best-effort; the watch's reaction (rollback,
            // alert) has happened by now, so every outcome goes on to lessons.
            def(
                "observe",
                Some("post-deploy-monitor"),
                Deterministic,
                vec![post_deploy_log_spec().optional()],
                vec![
                    (On::Pass, next("lessons")),
                    (On::NotSuccess, next("lessons")),
                ],
            )
            .run_by(executors::MONITOR)
            .on_release_track()
            .keeping_local_state()
            .also_writing(artifact(REVERT_LOG)),
            // The change is live: a problem writing lessons does not undo that.
            def(
                "lessons",
                Some("lessons"),
                Deterministic,
                vec![spec("17-lessons.md")],
                vec![
                    (On::Pass, Transition::Done),
                    (On::NotSuccess, Transition::Done),
                ],
            )
            .run_by(executors::LESSONS)
            .on_release_track()
            .writing_lessons(),
        ];
        Pipeline {
            stages,
            max_loops: DEFAULT_MAX_LOOPS,
        }
    }

    /// The stages of the release track ([`StageDef::release_track`]), in pipeline order.
    pub fn release_track(&self) -> Vec<StageName> {
        self.stages
            .iter()
            .filter(|s| s.release_track)
            .map(|s| s.name.clone())
            .collect()
    }

    /// The stage that writes the item's code (the first [`StageDef::writes_code`] one, the
    /// developer's `implementation` by default): its start opens a forge's pull request, and a
    /// forge review's change request sends the item back to it.
    pub fn code_stage(&self) -> Option<&StageDef> {
        self.stages.iter().find(|s| s.writes_code)
    }

    /// The stage a submitted work item starts in.
    pub fn first_stage(&self) -> Option<&StageName> {
        self.stages.first().map(|s| &s.name)
    }

    /// The definition of `name`, if it is a stage of this pipeline.
    pub fn stage(&self, name: &StageName) -> Option<&StageDef> {
        self.stages.iter().find(|s| s.name == *name)
    }

    /// Mutable access to the definition of `name` (for configuration overrides).
    pub fn stage_mut(&mut self, name: &StageName) -> Option<&mut StageDef> {
        self.stages.iter_mut().find(|s| s.name == *name)
    }

    /// The stage after `stage` in pipeline order, `done` after the last one; `None` for a
    /// terminal or unknown stage.
    pub fn next_after(&self, stage: &StageName) -> Option<StageName> {
        let i = self.stages.iter().position(|s| s.name == *stage)?;
        Some(
            self.stages
                .get(i + 1)
                .map_or_else(StageName::done, |s| s.name.clone()),
        )
    }

    /// Decides where a task in `stage` goes, given its gate's outcome and the number of loops
    /// back it has already taken.
    pub fn decide(
        &self,
        stage: &StageName,
        outcome: &GateOutcome,
        loops_so_far: u32,
    ) -> Result<Decision, PipelineError> {
        if stage.is_terminal() {
            return Err(PipelineError::Terminal(stage.clone()));
        }
        let def = self
            .stage(stage)
            .ok_or_else(|| PipelineError::UnknownStage(stage.clone()))?;
        let found = match &outcome.verdict {
            Verdict::Pass(v) => def
                .transitions
                .get(&On::Value(v.clone()))
                .or_else(|| def.transitions.get(&On::Pass)),
            Verdict::NotSuccess => def.transitions.get(&On::NotSuccess),
        };
        let because = &outcome.reason;
        let decision = match found {
            None => self.terminal(
                StageName::failed(),
                format!("{stage}: no transition for this outcome ({because})"),
            ),
            Some(Transition::Done) => {
                self.terminal(StageName::done(), format!("{stage}: {because}"))
            }
            Some(Transition::Fail) => {
                self.terminal(StageName::failed(), format!("{stage} failed: {because}"))
            }
            Some(Transition::Next(to)) => Decision {
                next_stage: to.clone(),
                loop_back: false,
                feedback: None,
                needs_approval: self.stage(to).is_some_and(|d| d.approval),
                reason: format!("{stage}: {because}"),
            },
            Some(Transition::LoopBack { to, feedback }) => {
                if loops_so_far >= self.max_loops {
                    self.terminal(
                        StageName::failed(),
                        format!(
                            "{stage}: {because}; not looping back to {to}: the bound of {} \
                             loops per work item is used up",
                            self.max_loops
                        ),
                    )
                } else {
                    Decision {
                        next_stage: to.clone(),
                        loop_back: true,
                        feedback: Some(feedback.clone()),
                        needs_approval: self.stage(to).is_some_and(|d| d.approval),
                        reason: format!(
                            "{stage}: {because}; loop {} of {} back to {to} with {feedback}",
                            loops_so_far + 1,
                            self.max_loops
                        ),
                    }
                }
            }
        };
        Ok(decision)
    }

    fn terminal(&self, next_stage: StageName, reason: String) -> Decision {
        Decision {
            next_stage,
            loop_back: false,
            feedback: None,
            needs_approval: false,
            reason,
        }
    }

    /// Checks that the pipeline can be run: unique, non-terminal stage names; an agent for each
    /// LLM stage; transitions to known stages for every gate outcome; feedback that is some
    /// stage's artifact; and a path to `done` from every stage.
    pub fn validate(&self) -> Result<(), PipelineError> {
        if self.stages.is_empty() {
            return Err(PipelineError::Empty);
        }
        let mut names = BTreeSet::new();
        for def in &self.stages {
            if def.name.is_terminal() {
                return Err(PipelineError::TerminalName(def.name.clone()));
            }
            if !names.insert(&def.name) {
                return Err(PipelineError::DuplicateStage(def.name.clone()));
            }
        }
        let artifacts: Vec<&ArtifactName> = self
            .stages
            .iter()
            .flat_map(|d| &d.artifacts)
            .filter_map(|a| match &a.name {
                ArtifactPattern::Exact(name) => Some(name),
                ArtifactPattern::Family(_) => None,
            })
            .collect();
        for def in &self.stages {
            self.validate_stage(def, &names, &artifacts)?;
        }
        self.validate_reachability()
    }

    fn validate_stage(
        &self,
        def: &StageDef,
        names: &BTreeSet<&StageName>,
        artifacts: &[&ArtifactName],
    ) -> Result<(), PipelineError> {
        let stage = &def.name;
        if def.kind == StageKind::Llm && def.agent.is_none() {
            return Err(PipelineError::MissingAgent(stage.clone()));
        }
        if def.executor.is_empty() {
            return Err(PipelineError::MissingExecutor(stage.clone()));
        }
        if def
            .artifacts
            .iter()
            .filter(|a| a.status_key.is_some())
            .count()
            > 1
        {
            return Err(PipelineError::SeveralStatusKeys(stage.clone()));
        }
        let values = def.status_values().unwrap_or(&[]);
        for (on, transition) in &def.transitions {
            // A stage without a status key can only be keyed on what its executor reports.
            let reported = REPORTED.iter().any(|r| v_is(on, r));
            if let On::Value(v) = on
                && !values.contains(v)
                && !reported
            {
                return Err(PipelineError::UnknownValue {
                    stage: stage.clone(),
                    value: v.clone(),
                });
            }
            let target = match transition {
                Transition::Next(to) => Some(to),
                Transition::LoopBack { to, feedback } => {
                    if !artifacts.contains(&feedback) {
                        return Err(PipelineError::UnknownFeedback {
                            stage: stage.clone(),
                            feedback: feedback.clone(),
                        });
                    }
                    Some(to)
                }
                Transition::Fail | Transition::Done => None,
            };
            if let Some(to) = target
                && !names.contains(to)
            {
                return Err(PipelineError::UnknownTarget {
                    from: stage.clone(),
                    on: on.clone(),
                    to: to.clone(),
                });
            }
        }
        let has = |on: &On| def.transitions.contains_key(on);
        let mut needed = vec![On::NotSuccess];
        if values.is_empty() {
            needed.push(On::Pass);
        } else if !has(&On::Pass) {
            needed.extend(values.iter().map(|v| On::Value(v.clone())));
        }
        match needed.into_iter().find(|on| !has(on)) {
            Some(on) => Err(PipelineError::MissingTransition {
                stage: stage.clone(),
                on,
            }),
            None => Ok(()),
        }
    }

    /// Every stage must be able to reach `done` through some sequence of outcomes.
    fn validate_reachability(&self) -> Result<(), PipelineError> {
        // Walk backwards from the stages that can finish.
        let mut reaches: BTreeSet<&StageName> = BTreeSet::new();
        let mut queue: VecDeque<&StageName> = self
            .stages
            .iter()
            .filter(|d| d.transitions.values().any(|t| *t == Transition::Done))
            .map(|d| &d.name)
            .collect();
        while let Some(name) = queue.pop_front() {
            if !reaches.insert(name) {
                continue;
            }
            for def in &self.stages {
                let leads_here = def.transitions.values().any(|t| match t {
                    Transition::Next(to) | Transition::LoopBack { to, .. } => to == name,
                    Transition::Fail | Transition::Done => false,
                });
                if leads_here && !reaches.contains(&def.name) {
                    queue.push_back(&def.name);
                }
            }
        }
        match self.stages.iter().find(|d| !reaches.contains(&d.name)) {
            Some(def) => Err(PipelineError::NoPathToDone(def.name.clone())),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str) -> StageName {
        name.parse().unwrap()
    }

    fn pass(v: &str) -> GateOutcome {
        GateOutcome::pass(v.to_owned(), format!("status {v}"))
    }

    fn not_success() -> GateOutcome {
        GateOutcome::not_success("`11-review.md` is missing")
    }

    /// Decides for the default pipeline and compares next stage, loop flag, feedback and a
    /// fragment of the reason.
    fn check(
        stage: &str,
        outcome: GateOutcome,
        loops: u32,
        expect: (&str, bool, Option<&str>, &str),
    ) {
        let p = Pipeline::default_pipeline();
        let d = p.decide(&s(stage), &outcome, loops).unwrap();
        let (next, loop_back, feedback, fragment) = expect;
        assert_eq!(
            d.next_stage.as_str(),
            next,
            "{stage} {outcome:?}: {}",
            d.reason
        );
        assert_eq!(d.loop_back, loop_back, "{stage} {outcome:?}");
        assert_eq!(d.feedback.as_ref().map(|f| f.as_str()), feedback, "{stage}");
        assert!(
            d.reason.contains(fragment),
            "{:?} lacks {fragment:?}",
            d.reason
        );
    }

    #[test]
    fn default_pipeline_is_valid_and_in_order() {
        let p = Pipeline::default_pipeline();
        assert_eq!(p.validate(), Ok(()));
        let pinned: Vec<&str> = p
            .stages
            .iter()
            .filter(|d| d.pinned)
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(pinned, ["deploy", "observe"], "the stages with local state");
        let flagged = |flag: fn(&StageDef) -> bool| -> Vec<&str> {
            p.stages
                .iter()
                .filter(|d| flag(d))
                .map(|d| d.name.as_str())
                .collect()
        };
        assert_eq!(
            flagged(|d| d.release_track),
            ["merge", "staging", "deploy", "observe", "lessons"],
            "the release track"
        );
        assert_eq!(flagged(|d| d.writes_code), ["implementation"]);
        assert_eq!(
            p.code_stage().map(|d| d.name.as_str()),
            Some("implementation"),
            "where a forge's change request sends an item back"
        );
        assert_eq!(flagged(|d| d.writes_lessons), ["lessons"]);
        assert_eq!(
            flagged(|d| d.also_writes.iter().any(|a| a.as_str() == REVERT_LOG)),
            ["deploy", "observe"],
            "the stages that may record a revert"
        );
        let runs: Vec<(&str, &str, &str)> = p
            .stages
            .iter()
            .map(|d| (d.name.as_str(), d.job_kind(), d.executor.as_str()))
            .collect();
        assert_eq!(
            runs,
            [
                ("intake", "intake", executors::INTAKE),
                ("analysis", "analyst", executors::AGENT),
                ("architecture", "architect", executors::AGENT),
                ("implementation", "developer", executors::AGENT),
                ("review", "reviewer", executors::AGENT),
                ("verification", "tester", executors::TESTER),
                ("merge", "merge-gate", executors::MERGE_GATE),
                ("staging", "deployer", executors::STAGING),
                ("deploy", "deployer", executors::DEPLOY),
                ("observe", "post-deploy-monitor", executors::MONITOR),
                ("lessons", "lessons", executors::LESSONS),
            ],
            "each stage's job kind and executor"
        );
        let mut nameless = p.clone();
        nameless.stages[5].executor.clear();
        assert_eq!(
            nameless.validate(),
            Err(PipelineError::MissingExecutor(s("verification")))
        );
        let names: Vec<&str> = p.stages.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "intake",
                "analysis",
                "architecture",
                "implementation",
                "review",
                "verification",
                "merge",
                "staging",
                "deploy",
                "observe",
                "lessons"
            ]
        );
        assert_eq!(p.max_loops, 3);
        assert_eq!(p.first_stage().map(StageName::as_str), Some("intake"));
        let agents: Vec<Option<&str>> = p
            .stages
            .iter()
            .map(|d| d.agent.as_ref().map(AgentName::as_str))
            .collect();
        assert_eq!(
            agents,
            [
                None,
                Some("analyst"),
                Some("architect"),
                Some("developer"),
                Some("reviewer"),
                Some("tester"),
                Some("merge-gate"),
                Some("deployer"),
                Some("deployer"),
                Some("post-deploy-monitor"),
                Some("lessons")
            ]
        );
    }

    #[test]
    fn decisions() {
        type Expect = (&'static str, bool, Option<&'static str>, &'static str);
        let cases: Vec<(&str, GateOutcome, u32, Expect)> = vec![
            (
                "intake",
                pass(""),
                0,
                ("analysis", false, None, "intake: status"),
            ),
            (
                "analysis",
                pass("draft"),
                0,
                ("architecture", false, None, "analysis"),
            ),
            (
                "analysis",
                not_success(),
                0,
                (
                    "failed",
                    false,
                    None,
                    "analysis failed: `11-review.md` is missing",
                ),
            ),
            (
                "architecture",
                pass(""),
                0,
                ("implementation", false, None, ""),
            ),
            ("implementation", pass(""), 0, ("review", false, None, "")),
            (
                "review",
                pass("APPROVED"),
                0,
                ("verification", false, None, "APPROVED"),
            ),
            (
                "review",
                pass("CHANGES_REQUESTED"),
                0,
                (
                    "implementation",
                    true,
                    Some("11-review.md"),
                    "loop 1 of 3 back to implementation with 11-review.md",
                ),
            ),
            (
                "review",
                pass("CHANGES_REQUESTED"),
                2,
                ("implementation", true, Some("11-review.md"), "loop 3 of 3"),
            ),
            (
                "review",
                pass("CHANGES_REQUESTED"),
                3,
                (
                    "failed",
                    false,
                    None,
                    "bound of 3 loops per work item is used up",
                ),
            ),
            (
                "review",
                not_success(),
                0,
                ("implementation", true, Some("11-review.md"), "is missing"),
            ),
            (
                "review",
                not_success(),
                5,
                ("failed", false, None, "used up"),
            ),
            (
                "verification",
                pass("PASSED"),
                0,
                ("merge", false, None, ""),
            ),
            (
                "verification",
                pass("FAILED"),
                1,
                (
                    "implementation",
                    true,
                    Some("12-test-report.md"),
                    "loop 2 of 3",
                ),
            ),
            ("merge", pass("MERGED"), 0, ("staging", false, None, "")),
            (
                "merge",
                pass("CONFLICT"),
                0,
                ("implementation", true, Some("14-merge-log.md"), ""),
            ),
            (
                "merge",
                pass("FAILED"),
                0,
                ("failed", false, None, "merge failed"),
            ),
            (
                "merge",
                not_success(),
                0,
                ("failed", false, None, "merge failed"),
            ),
            ("staging", pass("SUCCESS"), 0, ("deploy", false, None, "")),
            (
                "staging",
                pass("FAILED"),
                0,
                ("implementation", true, Some("15-staging-log.md"), ""),
            ),
            (
                "staging",
                not_success(),
                3,
                ("failed", false, None, "used up"),
            ),
            // The infrastructure stayed broken: never a loop back that blames the change.
            (
                "staging",
                pass(TOOL_ERROR_EXHAUSTED),
                0,
                ("failed", false, None, "staging failed"),
            ),
            ("deploy", pass("CONFIRMED"), 0, ("observe", false, None, "")),
            (
                "deploy",
                not_success(),
                0,
                ("failed", false, None, "deploy failed"),
            ),
            ("observe", pass("FAILED"), 0, ("lessons", false, None, "")),
            ("observe", not_success(), 0, ("lessons", false, None, "")),
            ("lessons", pass(""), 0, ("done", false, None, "")),
            ("lessons", not_success(), 0, ("done", false, None, "")),
        ];
        for (stage, outcome, loops, expect) in cases {
            check(stage, outcome, loops, expect);
        }
    }

    #[test]
    fn decide_rejects_unknown_and_terminal_stages() {
        let p = Pipeline::default_pipeline();
        assert_eq!(
            p.decide(&s("nowhere"), &pass(""), 0),
            Err(PipelineError::UnknownStage(s("nowhere")))
        );
        assert_eq!(
            p.decide(&StageName::done(), &pass(""), 0),
            Err(PipelineError::Terminal(StageName::done()))
        );
    }

    #[test]
    fn approval_of_the_next_stage_is_reported() {
        let mut p = Pipeline::default_pipeline();
        p.stage_mut(&s("deploy")).unwrap().approval = true;
        let d = p.decide(&s("staging"), &pass("SUCCESS"), 0).unwrap();
        assert!(d.needs_approval);
        let d = p.decide(&s("merge"), &pass("MERGED"), 0).unwrap();
        assert!(!d.needs_approval);
    }

    #[test]
    fn max_loops_zero_fails_on_the_first_loop() {
        let mut p = Pipeline::default_pipeline();
        p.max_loops = 0;
        let d = p
            .decide(&s("review"), &pass("CHANGES_REQUESTED"), 0)
            .unwrap();
        assert_eq!(d.next_stage, StageName::failed());
    }

    #[test]
    fn next_after() {
        let p = Pipeline::default_pipeline();
        let cases = [
            ("intake", Some("analysis")),
            ("review", Some("verification")),
            ("lessons", Some("done")),
            ("done", None),
            ("nowhere", None),
        ];
        for (stage, expect) in cases {
            assert_eq!(
                p.next_after(&s(stage)).as_ref().map(StageName::as_str),
                expect,
                "{stage}"
            );
        }
    }

    #[test]
    fn stage_check_uses_the_stage_artifacts() {
        let p = Pipeline::default_pipeline();
        let review = p.stage(&s("review")).unwrap();
        let id: WorkItemId = "ORCH-7".parse().unwrap();
        let text = "---\nwork_item: ORCH-7\nstage: review\nauthor_agent: reviewer\nstatus: done\n\
                    created_at: x\nmodel_used: m\nreview_status: CHANGES_REQUESTED\n---\n";
        let files = [("11-review.md".parse().unwrap(), text)];
        let outcome = review.check(&id, &files);
        let d = p.decide(&review.name, &outcome, 0).unwrap();
        assert_eq!(d.next_stage, s("implementation"));
        assert!(d.loop_back);
        let outcome = review.check(&id, &[]);
        assert_eq!(outcome.verdict, Verdict::NotSuccess);
    }

    /// Applies `change` to the default pipeline and expects `validate` to give `expect`.
    fn check_invalid(change: impl FnOnce(&mut Pipeline), expect: &str) {
        let mut p = Pipeline::default_pipeline();
        change(&mut p);
        let got = p.validate().map_err(|e| e.to_string());
        assert_eq!(got, Err(expect.to_owned()));
    }

    #[test]
    fn validation_errors() {
        check_invalid(|p| p.stages.clear(), "the pipeline has no stages");
        check_invalid(
            |p| {
                let dup = p.stages[1].clone();
                p.stages.push(dup);
            },
            "stage `analysis` is defined twice",
        );
        check_invalid(
            |p| p.stages[1].name = StageName::done(),
            "stage `done` uses the name of a terminal stage (done, failed, cancelled)",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("review")).unwrap().transitions.insert(
                    On::Value("APPROVED".into()),
                    Transition::Next(s("verifcation")),
                );
            },
            "stage `review`: on APPROVED, the transition goes to unknown stage `verifcation`",
        );
        check_invalid(
            |p| p.stage_mut(&s("analysis")).unwrap().agent = None,
            "stage `analysis` is an LLM stage but names no agent",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("review"))
                    .unwrap()
                    .transitions
                    .remove(&On::Value("APPROVED".into()));
            },
            "stage `review` has no transition for outcome APPROVED",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("analysis"))
                    .unwrap()
                    .transitions
                    .remove(&On::NotSuccess);
            },
            "stage `analysis` has no transition for outcome not success",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("review"))
                    .unwrap()
                    .transitions
                    .insert(On::Value("approved".into()), Transition::Fail);
            },
            "stage `review`: transition on `approved`, which is not an allowed status value",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("review"))
                    .unwrap()
                    .artifacts
                    .push(test_report_spec());
            },
            "stage `review` has more than one artifact with a status key",
        );
        check_invalid(
            |p| {
                p.stage_mut(&s("review")).unwrap().transitions.insert(
                    On::NotSuccess,
                    Transition::LoopBack {
                        to: s("implementation"),
                        feedback: "99-nothing.md".parse().unwrap(),
                    },
                );
            },
            "stage `review`: loop-back feedback `99-nothing.md` is not an artifact of any stage",
        );
        check_invalid(
            |p| {
                let lessons = p.stage_mut(&s("lessons")).unwrap();
                lessons.transitions.insert(On::Pass, Transition::Fail);
                lessons.transitions.insert(On::NotSuccess, Transition::Fail);
            },
            "stage `intake` has no path to `done`",
        );
        check_invalid(
            |p| {
                // Review loops forever between itself and implementation.
                let review = p.stage_mut(&s("review")).unwrap();
                review.transitions.insert(
                    On::Value("APPROVED".into()),
                    Transition::Next(s("implementation")),
                );
            },
            "stage `intake` has no path to `done`",
        );
    }
}

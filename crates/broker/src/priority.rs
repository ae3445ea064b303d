//! Priority classes in the broker: the classes themselves (`--priority`, `priorities:` in the
//! config file), where a request's class comes from (`--priority-from`), and what is counted
//! when a client names none or an unknown one.
//!
//! The classes are the core's (`admitgate_core::queue`): shares of the cap, fair queuing across
//! tenants within a class, shedding the least important first. The broker only picks each
//! request's class and hands it to the passage, so a broker and an in-process gate with the
//! same classes serve the same order.
//!
//! A request's class is a client's claim, like its tenant: a missing, unknown or unreadable
//! value is never an error. It goes to the default class and is counted
//! (`broker_priority_defaulted_total{cause}`), so an operator sees clients that name classes
//! the broker does not know.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use admitgate_passage::core_api::{ClassId, ClassStats, Order, Priorities, PriorityClass};
use admitgate_passage::Passage;
use serde::Deserialize;

/// The priority flags (flattened into [`crate::config::Flags`]).
#[derive(clap::Args, Debug, Default, Clone)]
pub struct PriorityFlags {
    /// A priority class, most important first (repeat the flag for each):
    /// `NAME[:min=F][,max=F]`, F a fraction of --max-in-flight: `min` guaranteed while the
    /// class has work, `max` a hard cap. `--priority interactive:min=0.5 --priority batch`.
    /// Default: no classes (one FIFO queue).
    #[arg(long = "priority", value_name = "CLASS")]
    pub priority: Vec<String>,
    /// The class of a request that names none or an unknown one. Default: the last class.
    #[arg(long, value_name = "NAME")]
    pub default_priority: Option<String>,
    /// Where a request's class is read: `header:NAME` (an HTTP header), `metadata:KEY` (a
    /// gRPC metadata key; HTTP requests are read for the header of that name too) or
    /// `tenant` (the tenant's name, from --tenant-from, names its class). Needs --priority.
    /// Default: every request in the default class.
    #[arg(long, value_name = "SOURCE")]
    pub priority_from: Option<String>,
    /// Fair queuing across tenants (--tenant-from) within each class: `tenant` (the default
    /// with classes) or `none` (FIFO within a class).
    #[arg(long, value_name = "MODE")]
    pub fairness: Option<String>,
}

/// One class in the config file: `interactive:min=0.5` as on the command line, or a map
/// `{name: interactive, min_share: 0.5, max_share: 1.0}` as in a gateway's YAML.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum FileClass {
    /// `NAME[:min=F][,max=F]`.
    Text(String),
    /// `{name, min_share, max_share}`.
    Map {
        name: String,
        #[serde(default)]
        min_share: Option<f64>,
        #[serde(default)]
        max_share: Option<f64>,
    },
}

/// The priority settings of the config file.
#[derive(Debug, Default)]
pub struct FileSettings {
    pub priorities: Option<Vec<FileClass>>,
    pub default_priority: Option<String>,
    pub priority_from: Option<String>,
    pub fairness: Option<String>,
}

/// Where a request's class is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PriorityFrom {
    /// Nowhere: every request is in the default class.
    None,
    /// An HTTP header or gRPC metadata key (lowercase).
    Header(http::HeaderName),
    /// The request's tenant names its class.
    Tenant,
}

/// The validated priority settings.
#[derive(Clone, Debug)]
pub struct PrioritySettings {
    /// The queue's order (classes, fairness); `None`: no classes, one FIFO queue as before.
    pub order: Option<Order>,
    /// Where a request's class comes from.
    pub from: PriorityFrom,
}

impl Default for PrioritySettings {
    fn default() -> Self {
        Self {
            order: None,
            from: PriorityFrom::None,
        }
    }
}

/// A class name is what clients send in a header and refusals send back in one: letters,
/// digits, `_`, `-` and `.`.
fn check_name(class: &str) -> Result<(), &'static str> {
    if class.is_empty()
        || !class
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
    {
        return Err("a non-empty name of letters, digits, '_', '-' or '.'");
    }
    Ok(())
}

/// Parses `NAME[:min=F][,max=F]`; `name` is the setting as typed, for the message.
fn parse_class(name: &str, text: &str) -> Result<PriorityClass, String> {
    let bad = |why: &str| format!("{name} must be NAME[:min=F][,max=F] ({why}), got {text:?}");
    let (class, shares) = match text.split_once(':') {
        Some((class, shares)) => (class, Some(shares)),
        None => (text, None),
    };
    if let Err(why) = check_name(class) {
        return Err(bad(why));
    }
    let (mut min, mut max) = (0.0, 1.0);
    for share in shares.into_iter().flat_map(|s| s.split(',')) {
        let (key, value) = share
            .split_once('=')
            .ok_or_else(|| bad("a share is min=F or max=F"))?;
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|_| bad("a share is a number from 0 to 1"))?;
        match key.trim() {
            "min" | "min_share" => min = value,
            "max" | "max_share" => max = value,
            _ => return Err(bad("a share is min=F or max=F")),
        }
    }
    Ok(PriorityClass::shared(class, min, max))
}

/// Resolves the priority flags over the file's settings (flags win). `name(field, from_file)`
/// names a setting as the user gave it; `tenant` says whether --tenant-from is set.
pub fn resolve(
    flags: &PriorityFlags,
    file: FileSettings,
    name: impl Fn(&str, bool) -> String,
    tenant: bool,
) -> Result<PrioritySettings, String> {
    let err = |message: String| Err(message);
    let (classes, classes_name) = if !flags.priority.is_empty() {
        let setting = name("priority", false);
        let classes = flags
            .priority
            .iter()
            .map(|text| parse_class(&setting, text))
            .collect::<Result<Vec<_>, _>>()?;
        (classes, setting)
    } else if let Some(listed) = file.priorities {
        let setting = name("priorities", true);
        let classes = listed
            .into_iter()
            .map(|class| match class {
                FileClass::Text(text) => parse_class(&setting, &text),
                FileClass::Map {
                    name,
                    min_share,
                    max_share,
                } => match check_name(&name) {
                    Ok(()) => Ok(PriorityClass::shared(
                        &name,
                        min_share.unwrap_or(0.0),
                        max_share.unwrap_or(1.0),
                    )),
                    Err(why) => Err(format!(
                        "{setting}: a class name must be {why}, got {name:?}"
                    )),
                },
            })
            .collect::<Result<Vec<_>, _>>()?;
        (classes, setting)
    } else {
        (Vec::new(), name("priority", false))
    };
    let default_from_file = flags.default_priority.is_none();
    let default = flags
        .default_priority
        .clone()
        .or(file.default_priority.clone());
    let from_from_file = flags.priority_from.is_none();
    let from_text = flags.priority_from.clone().or(file.priority_from.clone());
    let fairness_from_file = flags.fairness.is_none();
    let fairness = flags.fairness.clone().or(file.fairness.clone());
    let from_name = name(
        "priority_from",
        from_from_file && file.priority_from.is_some(),
    );
    let from = match from_text.as_deref() {
        None | Some("") => PriorityFrom::None,
        Some("tenant") => PriorityFrom::Tenant,
        Some(other) => {
            let header = other
                .strip_prefix("header:")
                .or_else(|| other.strip_prefix("metadata:"));
            match header {
                Some(key) => match http::HeaderName::from_bytes(key.as_bytes()) {
                    // A `-bin` key carries bytes, never a class name.
                    Ok(parsed) if !key.is_empty() && !parsed.as_str().ends_with("-bin") => {
                        PriorityFrom::Header(parsed)
                    }
                    _ => {
                        return err(format!(
                            "{from_name} {} must be an HTTP header name (a gRPC metadata key \
                             not ending in -bin), got {key:?}",
                            if other.starts_with("header:") {
                                "header:NAME"
                            } else {
                                "metadata:KEY"
                            }
                        ))
                    }
                },
                None => {
                    return err(format!(
                        "{from_name} must be header:NAME, metadata:KEY or tenant, got {other:?}"
                    ))
                }
            }
        }
    };
    if classes.is_empty() {
        for (set, setting) in [
            (
                default.is_some(),
                name("default_priority", default_from_file),
            ),
            (from != PriorityFrom::None, from_name.clone()),
            (fairness.is_some(), name("fairness", fairness_from_file)),
        ] {
            if set {
                return err(format!(
                    "{setting} needs priority classes ({classes_name} NAME[:min=F][,max=F])"
                ));
            }
        }
        return Ok(PrioritySettings::default());
    }
    if from == PriorityFrom::Tenant && !tenant {
        return err(format!(
            "{from_name} tenant needs {} (header:NAME or path)",
            name("tenant_from", false)
        ));
    }
    let priorities = Priorities::new(classes, default.as_deref()).map_err(|e| {
        let text = e.to_string();
        let setting = if text.starts_with("default_priority") {
            name("default_priority", default_from_file)
        } else {
            classes_name.clone()
        };
        format!("{setting}: {text}")
    })?;
    let fair = match fairness.as_deref() {
        None | Some("tenant") => true,
        Some("none") => false,
        Some(other) => {
            return err(format!(
                "{} must be tenant or none, got {other:?}",
                name("fairness", fairness_from_file)
            ))
        }
    };
    Ok(PrioritySettings {
        order: Some(Order {
            priorities,
            fair,
            weights: HashMap::new(),
        }),
        from,
    })
}

/// Why a request went to the default class without naming it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Defaulted {
    /// It named none (no header, an empty one, no tenant).
    Missing,
    /// It named a class the broker does not have (or a value that is not text).
    Unknown,
}

/// A request's class, read from it as `--priority-from` says, with the count of requests
/// that went to the default class without naming it.
#[derive(Debug)]
pub struct ClassPicker {
    from: PriorityFrom,
    priorities: Option<Priorities>,
    /// The classes' names, in position order (for refusals and metrics).
    names: Arc<[Arc<str>]>,
    missing: AtomicU64,
    unknown: AtomicU64,
}

impl ClassPicker {
    /// The picker for `settings`.
    pub fn new(settings: &PrioritySettings) -> Self {
        let priorities = settings.order.as_ref().map(|o| o.priorities.clone());
        let names: Arc<[Arc<str>]> = priorities
            .as_ref()
            .map_or_else(Vec::new, Priorities::names)
            .into();
        Self {
            from: settings.from.clone(),
            priorities,
            names,
            missing: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
        }
    }

    /// Whether the broker has classes.
    pub fn classed(&self) -> bool {
        self.priorities.is_some()
    }

    /// The class of a request with `headers` and `tenant`; [`ClassId::DEFAULT`] without
    /// classes. Counts a missing or unknown value.
    pub fn pick(&self, headers: &http::HeaderMap, tenant: &str) -> ClassId {
        let Some(priorities) = &self.priorities else {
            return ClassId::DEFAULT;
        };
        let value = match &self.from {
            PriorityFrom::None => return priorities.default_class(),
            PriorityFrom::Header(name) => headers.get(name).map(|v| v.to_str()),
            PriorityFrom::Tenant => Some(Ok(tenant)),
        };
        let found = match value {
            None => Err(Defaulted::Missing),
            Some(Ok(text)) if text.trim().is_empty() => Err(Defaulted::Missing),
            Some(Ok(text)) => priorities.find(text.trim()).ok_or(Defaulted::Unknown),
            Some(Err(_)) => Err(Defaulted::Unknown),
        };
        match found {
            Ok(class) => class,
            Err(why) => {
                let counter = match why {
                    Defaulted::Missing => &self.missing,
                    Defaulted::Unknown => &self.unknown,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                priorities.default_class()
            }
        }
    }

    /// The name of `class` (a position from [`ClassPicker::pick`]), `None` without classes.
    pub fn name(&self, class: ClassId) -> Option<&str> {
        let priorities = self.priorities.as_ref()?;
        self.names
            .get(priorities.resolve(class))
            .map(|name| &**name)
    }

    /// Requests that named no class, and requests that named an unknown one.
    pub fn defaulted(&self) -> (u64, u64) {
        (
            self.missing.load(Ordering::Relaxed),
            self.unknown.load(Ordering::Relaxed),
        )
    }
}

/// One per-class metric family: name, type, help, and its value for a class.
type Family = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ClassStats) -> u64,
);

/// The per-class metric families, on a broker with classes (none without: its exposition
/// stays as it was). Families of their own (`broker_class_*`) rather than a `class` label on
/// `broker_inflight_requests`, whose `transport` series already add up to the whole: a sum
/// over that name (the KEDA trigger's, the dashboard's) would count every request twice.
/// Never a tenant label: tenants are unbounded, classes a few.
pub fn render_metrics(out: &mut String, passage: &Passage, picker: &ClassPicker) {
    use std::fmt::Write;
    if !picker.classed() {
        return;
    }
    let (_, classes) = passage.stats_and_classes();
    let families: [Family; 7] = [
        (
            "broker_class_inflight_requests",
            "gauge",
            "Gated requests holding a slot, by priority class.",
            |c| c.in_flight,
        ),
        (
            "broker_class_queued_requests",
            "gauge",
            "Gated requests waiting for a slot, by priority class.",
            |c| c.queued,
        ),
        (
            "broker_class_admitted_total",
            "counter",
            "Gated requests admitted, by priority class.",
            |c| c.tally.admitted,
        ),
        (
            "broker_class_rejected_total",
            "counter",
            "Gated requests refused (on arrival or while waiting; shed ones are counted apart), \
             by priority class.",
            |c| c.tally.rejected,
        ),
        (
            "broker_class_shed_total",
            "counter",
            "Waiting requests evicted to make room for a more important one, by priority class.",
            |c| c.tally.shed,
        ),
        (
            "broker_class_cancelled_total",
            "counter",
            "Requests whose client left while they waited, by priority class.",
            |c| c.tally.cancelled,
        ),
        (
            "broker_class_guaranteed_slots",
            "gauge",
            "Slots each priority class is guaranteed under the cap now (min share).",
            |c| c.slots.guarantee,
        ),
    ];
    for (name, kind, help, value) in families {
        crate::exposition::family(out, name, kind, help);
        for class in &classes {
            let _ = writeln!(out, "{name}{{class=\"{}\"}} {}", class.name, value(class));
        }
    }
    let (missing, unknown) = picker.defaulted();
    crate::exposition::family(
        out,
        "broker_priority_defaulted_total",
        "counter",
        "Gated requests put in the default class because they named no class (missing) or \
         one the broker does not have (unknown).",
    );
    let _ = writeln!(
        out,
        "broker_priority_defaulted_total{{cause=\"missing\"}} {missing}"
    );
    let _ = writeln!(
        out,
        "broker_priority_defaulted_total{{cause=\"unknown\"}} {unknown}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(args: &[&str]) -> Result<PrioritySettings, String> {
        let mut all = vec!["b", "--upstream", "http://x:1"];
        all.extend_from_slice(args);
        crate::config::Config::from_args(all)
            .map(|c| c.priority)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn classes_parse_in_order_with_shares() {
        let s = settings(&[
            "--priority",
            "interactive:min=0.5",
            "--priority",
            "batch:min=0.2,max=0.8",
            "--priority-from",
            "header:X-Priority",
        ])
        .unwrap();
        let order = s.order.unwrap();
        let classes = order.priorities.classes();
        assert_eq!(&*classes[0].name, "interactive");
        assert_eq!((classes[0].min_share, classes[0].max_share), (0.5, 1.0));
        assert_eq!((classes[1].min_share, classes[1].max_share), (0.2, 0.8));
        assert_eq!(order.priorities.default_class(), ClassId(1));
        assert!(order.fair);
        assert_eq!(
            s.from,
            PriorityFrom::Header(http::HeaderName::from_static("x-priority"))
        );
        let s = settings(&["--priority", "a", "--fairness", "none"]).unwrap();
        assert!(!s.order.unwrap().fair);
        assert_eq!(s.from, PriorityFrom::None);
        assert!(settings(&[]).unwrap().order.is_none());
    }

    #[test]
    fn bad_values_are_named_as_typed() {
        for (args, needle) in [
            (&["--priority", "a:min=2"][..], "--priority: min_share"),
            (&["--priority", "a:min=x"][..], "--priority must be"),
            (&["--priority", "a:low=1"][..], "\"a:low=1\""),
            (&["--priority", ":min=0.1"][..], "a non-empty name"),
            (&["--priority", "a", "--priority", "a"][..], "twice"),
            (
                &["--priority", "a:min=0.7", "--priority", "b:min=0.7"][..],
                "sum to",
            ),
            (
                &["--priority", "a", "--default-priority", "z"][..],
                "--default-priority: default_priority 'z'",
            ),
            (
                &["--priority", "a", "--priority-from", "cookie:x"][..],
                "--priority-from must be header:NAME, metadata:KEY or tenant, got \"cookie:x\"",
            ),
            (
                &["--priority", "a", "--priority-from", "metadata:x-bin"][..],
                "--priority-from metadata:KEY",
            ),
            (
                &["--priority", "a", "--priority-from", "tenant"][..],
                "--priority-from tenant needs --tenant-from",
            ),
            (
                &["--priority-from", "header:x-priority"][..],
                "--priority-from needs priority classes",
            ),
            (
                &["--priority", "a", "--fairness", "weighted"][..],
                "--fairness must be tenant or none, got \"weighted\"",
            ),
        ] {
            let e = settings(args).unwrap_err();
            assert!(e.contains(needle), "{args:?}: {e}");
            assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        }
    }

    #[test]
    fn the_config_file_takes_lists_and_maps() {
        let path =
            std::env::temp_dir().join(format!("admitgate-priority-{}.yaml", std::process::id()));
        std::fs::write(
            &path,
            "upstream: http://127.0.0.1:9\npriorities:\n  - interactive:min=0.5\n  - {name: batch, \
             min_share: 0.2, max_share: 0.9}\ndefault_priority: interactive\npriority_from: \
             metadata:x-class\n",
        )
        .unwrap();
        let s = settings(&["--config", path.to_str().unwrap()]).unwrap();
        let order = s.order.unwrap();
        assert_eq!(order.priorities.classes()[1].max_share, 0.9);
        assert_eq!(order.priorities.default_class(), ClassId(0));
        std::fs::write(
            &path,
            "upstream: http://127.0.0.1:9\npriorities: [\"a:min=3\"]\n",
        )
        .unwrap();
        let e = settings(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("priorities (in "), "{e}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_missing_or_unknown_class_is_the_default_and_counted() {
        let s = settings(&[
            "--priority",
            "hi",
            "--priority",
            "lo",
            "--priority-from",
            "header:x-priority",
        ])
        .unwrap();
        let picker = ClassPicker::new(&s);
        let mut headers = http::HeaderMap::new();
        assert_eq!(picker.pick(&headers, ""), ClassId(1));
        headers.insert("x-priority", http::HeaderValue::from_static(" hi "));
        assert_eq!(picker.pick(&headers, ""), ClassId(0));
        headers.insert("x-priority", http::HeaderValue::from_static("urgent"));
        assert_eq!(picker.pick(&headers, ""), ClassId(1));
        headers.insert(
            "x-priority",
            http::HeaderValue::from_bytes(b"\xffhi").unwrap(),
        );
        assert_eq!(picker.pick(&headers, ""), ClassId(1));
        assert_eq!(picker.defaulted(), (1, 2));
        assert_eq!(picker.name(ClassId(0)), Some("hi"));
        let by_tenant = ClassPicker::new(
            &settings(&[
                "--priority",
                "gold",
                "--priority",
                "free",
                "--priority-from",
                "tenant",
                "--tenant-from",
                "header:x-tenant",
            ])
            .unwrap(),
        );
        assert_eq!(by_tenant.pick(&headers, "gold"), ClassId(0));
        assert_eq!(by_tenant.pick(&headers, "acme"), ClassId(1));
        assert_eq!(by_tenant.pick(&headers, ""), ClassId(1));
        assert_eq!(by_tenant.defaulted(), (1, 1));
        let plain = ClassPicker::new(&PrioritySettings::default());
        assert_eq!(plain.pick(&headers, ""), ClassId::DEFAULT);
        assert_eq!(plain.name(ClassId::DEFAULT), None);
    }
}

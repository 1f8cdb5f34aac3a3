//! The agent's socket protocol: a request line as the agent reads it, and the agent's answer as
//! capture-cni reads it.

#![no_main]

use capture_model::api::{parse_request, parse_response, request_line, FailureKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(request) => {
            let line = request_line(&request);
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            let again = parse_request(line.as_bytes())
                .unwrap_or_else(|e| panic!("a request as sent is refused: {e:?}: {line}"));
            assert_eq!(again, request, "a request changed on the wire");
        }
        Err(refusal) => {
            assert!(!refusal.ok);
            assert_eq!(refusal.kind, Some(FailureKind::BadRequest));
            assert!(refusal.error.as_deref().is_some_and(|e| !e.is_empty()));
        }
    }
    if let Ok(answer) = std::str::from_utf8(data) {
        if let Ok(response) = parse_response(answer) {
            let line = serde_json::to_string(&response).expect("responses serialise");
            let again = parse_response(&line)
                .unwrap_or_else(|e| panic!("an answer as sent does not read back ({e}): {line}"));
            assert_eq!(again, response);
        }
    }
});

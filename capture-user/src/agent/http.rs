//! The agent's localhost HTTP endpoint: `/healthz`, `/readyz` and `/metrics`. Three fixed GET
//! routes, so a small HTTP/1.1 responder serves them without a web framework.

use std::sync::Arc;

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

use super::{metrics, Agent};

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// Serves one connection (one request).
pub async fn serve(agent: Arc<Agent>, mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        if len == buf.len() {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            )
            .await;
        }
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
    }
    let request = String::from_utf8_lossy(&buf[..len]);
    let mut first = request
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace();
    let (method, path) = (
        first.next().unwrap_or_default(),
        first.next().unwrap_or_default(),
    );
    if method != "GET" {
        return respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        )
        .await;
    }
    match path {
        "/healthz" => respond(&mut stream, "200 OK", "text/plain", "ok\n").await,
        "/readyz" if agent.is_ready() => {
            respond(&mut stream, "200 OK", "text/plain", "ready\n").await
        }
        "/readyz" => {
            respond(
                &mut stream,
                "503 Service Unavailable",
                "text/plain",
                "not ready\n",
            )
            .await
        }
        "/metrics" => match agent.render_metrics().await {
            Ok(body) => respond(&mut stream, "200 OK", metrics::CONTENT_TYPE, &body).await,
            Err(e) => {
                let body = format!("encoding the metrics failed: {e}\n");
                respond(
                    &mut stream,
                    "500 Internal Server Error",
                    "text/plain",
                    &body,
                )
                .await
            }
        },
        _ => {
            respond(
                &mut stream,
                "404 Not Found",
                "text/plain",
                "try /healthz, /readyz or /metrics\n",
            )
            .await
        }
    }
}
